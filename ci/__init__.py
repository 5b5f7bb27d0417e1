"""Deployment tooling the Makefile and CI call: job specs, images, Ray Jobs, KubeRay, templates."""
