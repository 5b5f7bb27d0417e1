#!/usr/bin/env bash
# A kind cluster with the KubeRay operator, for `make run-kuberay`. Needs docker, kind, helm,
# kubectl (none of them run on the templates' dev machines; GitHub Actions has them).
set -euo pipefail
cd "$(dirname "$0")/.."
cluster=${KIND_CLUSTER:-ray-templates}
kuberay_version=${KUBERAY_VERSION:-1.7.0}
for tool in docker kind helm kubectl; do
  command -v "$tool" >/dev/null || { echo "error: $tool is not installed; make kind-up needs docker, kind, helm and kubectl." >&2; exit 2; }
done
mkdir -p /tmp/kind-ray-runs && chmod 1777 /tmp/kind-ray-runs
if ! kind get clusters | grep -qx "$cluster"; then
  kind create cluster --name "$cluster" --config ci/kind-config.yaml --wait 180s
fi
kubectl config use-context "kind-$cluster"
helm repo add kuberay https://ray-project.github.io/kuberay-helm/ --force-update >/dev/null
helm upgrade --install kuberay-operator kuberay/kuberay-operator \
  --version "$kuberay_version" --wait --timeout 5m
kubectl rollout status deployment/kuberay-operator --timeout 180s
echo "kind cluster '$cluster' is up with kuberay-operator $kuberay_version"
