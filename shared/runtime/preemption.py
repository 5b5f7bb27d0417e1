"""Preemption: a SIGTERM (what Kubernetes and Anyscale send before taking a pod or a node)
makes the run save a checkpoint at the next step boundary and stop cleanly, so the rerun
resumes from that step instead of the last periodic checkpoint.

What Ray Train 2.60 offers and what it does not:
  * a node *drain* (spot reclaim through the autoscaler, ``ray drain-node``) shows up in
    ``ray.train.get_preemption_info()``; the loop saves a just-in-time checkpoint when it does
    and keeps training, and Ray Train restarts the group under
    ``FailureConfig(max_preemption_failures)`` once the node is gone (``PreemptionError``);
  * a SIGTERM to a worker process or to the driver is not a drain: Ray's own handler exits the
    process at once. So a worker gets our handler on its main thread (the backend runs it
    there at worker-group start, where ``signal.signal`` is allowed), and the driver forwards
    its SIGTERM to the workers through a small named actor.

Every rank must stop at the same step: each step boundary all-reduces one flag.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

EXIT_PREEMPTED = 143  # 128 + SIGTERM: the platform's retry (max_retries, backoffLimit) reruns it
_stop = threading.Event()  # set by this process's SIGTERM handler
# Set while the loop trains. Outside it (start-up, and the shutdown SIGTERM Ray sends every
# worker after a finished run) a SIGTERM gets the handler that was there before ours.
_training = threading.Event()


def training(active: bool) -> None:
    """The loop says when a step boundary is still to come (only then is a SIGTERM a stop)."""
    (_training.set if active else _training.clear)()


def stop_requested_locally() -> bool:
    return _stop.is_set()


def _exit_after(grace_s: float, what: str) -> None:
    """The grace period: if the step boundary is not reached in time, exit anyway."""

    def expire():
        print(f"{what}: no step boundary within preemption_grace_s={grace_s:g}; exiting",
              file=sys.stderr, flush=True)  # fmt: skip
        os._exit(EXIT_PREEMPTED)

    timer = threading.Timer(grace_s, expire)
    timer.daemon = True
    timer.start()


def install_worker_handler(grace_s: float) -> None:
    """SIGTERM -> checkpoint at the next step boundary (a second SIGTERM exits at once).
    Must run on the process's main thread."""

    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        if not _training.is_set():
            if callable(previous):
                return previous(signum, frame)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return None
        if _stop.is_set():
            os._exit(EXIT_PREEMPTED)
        _stop.set()
        print(f"SIGTERM received (pid {os.getpid()}): checkpoint at the next step boundary, "
              "then stop", file=sys.stderr, flush=True)  # fmt: skip
        _exit_after(grace_s, "SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)


# --- driver side ---------------------------------------------------------------------------


def stop_flag_name(cfg) -> str:
    """One flag per driver (run and start time): a second driver never shares the first's."""
    from shared.checkpoint import run_key

    return f"stop-{run_key(cfg.run_dir)}-{cfg.driver_start_time}"


def start_stop_flag(cfg):
    """A named actor the workers poll, and a driver SIGTERM handler that sets it."""
    import ray

    @ray.remote(num_cpus=0)
    class StopFlag:
        def __init__(self):
            self.stop = False

        def set(self) -> None:
            self.stop = True

        def get(self) -> bool:
            return self.stop

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On the driver's node: a flag on a worker node would die with that node, and every
    # later attempt would find it dead.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    flag = StopFlag.options(name=stop_flag_name(cfg), scheduling_strategy=here).remote()
    ray.get(flag.get.remote())

    def on_sigterm(signum, frame):
        if _stop.is_set():
            os._exit(EXIT_PREEMPTED)
        _stop.set()
        print("SIGTERM received by the driver: the workers checkpoint at the next step "
              "boundary, then stop", file=sys.stderr, flush=True)  # fmt: skip
        flag.set.remote()
        # The workers' grace period, plus time to shut the cluster down.
        _exit_after(cfg.preemption_grace_s + 30, "SIGTERM (driver)")

    signal.signal(signal.SIGTERM, on_sigterm)
    return flag


class StopCheck:
    """Asked at every step boundary, on every rank: should the run stop now?

    True when any rank received SIGTERM, the driver did (its flag actor, polled without
    blocking by rank 0), or Ray Train reports a node drain (asked every ``drain_every`` steps:
    ``get_preemption_info`` is a barrier of its own)."""

    def __init__(self, cfg, rank: int, drain_every: int, use_ray: bool = True,
                 device: torch.device | None = None):  # fmt: skip
        self.rank = rank
        self.device = device or torch.device("cpu")  # NCCL all-reduces device tensors only
        self.drain_every = drain_every
        self.use_ray = use_ray
        self.drained = False  # a just-in-time checkpoint was already saved for the drain
        self._flag, self._pending = None, None
        self._next_poll = 0.0  # the driver's flag is asked at most once a second (an actor call)
        if use_ray and rank == 0:
            import ray

            try:
                self._flag = ray.get_actor(stop_flag_name(cfg))
            except ValueError:
                self._flag = None  # a driver without the flag (e.g. an older launcher)

    def _driver_asked(self) -> bool:
        if self._flag is None:
            return False
        import ray

        if self._pending is None:
            if time.monotonic() < self._next_poll:
                return False
            self._next_poll = time.monotonic() + 1.0
            self._pending = self._flag.get.remote()
        ready, _ = ray.wait([self._pending], timeout=0)
        if not ready:
            return False
        self._pending = None
        try:
            return bool(ray.get(ready[0]))
        except ray.exceptions.RayActorError:
            # The driver's node went away with its flag: train on, without the relay.
            print("preemption: the driver's stop flag is gone; a SIGTERM to the driver no "
                  "longer reaches the workers", file=sys.stderr, flush=True)  # fmt: skip
            self._flag = None
            return False

    def stop(self) -> bool:
        local = stop_requested_locally() or (self.rank == 0 and self._driver_asked())
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def node_draining(self, step: int) -> bool:
        """A Ray Core node drain seen for the first time (checked every drain_every steps)."""
        if not self.use_ray or self.drained or step % self.drain_every:
            return False
        import ray.train

        if ray.train.get_preemption_info() is None:
            return False
        self.drained = True
        return True


def torch_config_class():
    """``TorchConfig`` whose backend also installs the worker SIGTERM handler: the backend's
    hook runs as an actor task, on the worker's main thread, at every worker-group start."""
    from dataclasses import dataclass

    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    class _PreemptibleBackend(_TorchBackend):
        def on_training_start(self, worker_group, backend_config) -> None:
            super().on_training_start(worker_group, backend_config)
            worker_group.execute(install_worker_handler, backend_config.preemption_grace_s)

    @dataclass
    class PreemptibleTorchConfig(TorchConfig):
        preemption_grace_s: float = 30.0

        @property
        def backend_cls(self):
            return _PreemptibleBackend

    return PreemptibleTorchConfig
