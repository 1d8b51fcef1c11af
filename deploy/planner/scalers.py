"""What carries out the live planner's decisions, on Kubernetes or on Ray.

On Kubernetes the planner sets the prefill and decode Deployments' replicas through their
`scale` subresource (a merge patch of spec.replicas, with the official `kubernetes` client),
as an HPA does; the RBAC it needs is k8s/overlays/planner. When Kubernetes removes a pod it
sends SIGTERM, and the worker drains before it exits (deploy/processes.py): a prefill worker
refuses new prompts and waits until every push it made is acknowledged (parked K/V included),
a decode worker until its streams end, or past --drain-timeout-s hands them to the router to
migrate; the pods' terminationGracePeriodSeconds outlasts that timeout
(tests/k8s/test_k8s_consistency.py). A scale-down therefore never cuts a request off.

On Ray the planner runs in the driver that started the deployment (`kvferry serve
--kv-transport ray --planner-sla ...`) and starts or ends worker actors itself
(deploy/ray_launcher.RayDeployment): a new worker is handed to the router once it serves; a
leaving one (the one with the fewest open requests) is taken off the router's list first,
then drains as above, then ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SCALE_API_VERSION = "autoscaling/v1"
IN_CLUSTER = "in-cluster"  # the namespace: the pod's own, from its service account
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class Scaler(Protocol):
    def current(self) -> tuple[int, int]:
        """The prefill and decode workers asked for now."""
        ...

    def scale(self, num_prefill: int, num_decode: int) -> None: ...


def replicas_patch(replicas: int) -> dict[str, Any]:
    """The merge patch of a Deployment's scale subresource."""
    if replicas < 0:
        raise ValueError(f"replicas: must be >= 0, got {replicas}")
    return {"spec": {"replicas": replicas}}


def scale_object(name: str, namespace: str, replicas: int) -> dict[str, Any]:
    """The autoscaling/v1 Scale the patch leaves (what the API validates)."""
    return {"apiVersion": SCALE_API_VERSION, "kind": "Scale",
            "metadata": {"name": name, "namespace": namespace},
            **replicas_patch(replicas)}


@dataclass
class KubernetesScaler:
    """The prefill and decode Deployments of one namespace, through `apps/v1`."""

    namespace: str
    prefill_deployment: str
    decode_deployment: str
    api: Any = None  # a kubernetes.client.AppsV1Api; None: from the pod's service account

    def __post_init__(self) -> None:
        if self.namespace == IN_CLUSTER:
            self.namespace = Path(NAMESPACE_FILE).read_text().strip()
        if self.api is None:
            from kubernetes import client, config

            config.load_incluster_config()
            self.api = client.AppsV1Api()

    def _replicas(self, name: str) -> int:
        scale = self.api.read_namespaced_deployment_scale(name, self.namespace)
        return int(scale.spec.replicas or 0)

    def current(self) -> tuple[int, int]:
        return self._replicas(self.prefill_deployment), self._replicas(self.decode_deployment)

    def scale(self, num_prefill: int, num_decode: int) -> None:
        for name, replicas in ((self.prefill_deployment, num_prefill),
                               (self.decode_deployment, num_decode)):
            # a merge patch: the client would label a dict a JSON patch, which the API
            # refuses (a JSON patch is a list of operations)
            self.api.patch_namespaced_deployment_scale(
                name, self.namespace, replicas_patch(replicas),
                _content_type="application/merge-patch+json")


class WorkerActors(Protocol):
    """A deployment that starts and ends its own workers (deploy/ray_launcher.RayDeployment)."""

    @property
    def metrics_address(self) -> str: ...

    def addresses(self, role: str) -> list[str]: ...

    def add_worker(self, role: str) -> str: ...

    def remove_worker(self, role: str) -> str: ...


@dataclass
class RayScaler:
    """The worker actors of a running Ray deployment. Workers are added before any leaves,
    so a rebalance never drops below what ran."""

    deployment: WorkerActors

    def current(self) -> tuple[int, int]:
        return (len(self.deployment.addresses("prefill")),
                len(self.deployment.addresses("decode")))

    def scale(self, num_prefill: int, num_decode: int) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("replicas: a Ray deployment keeps at least one worker per role")
        wanted = {"prefill": num_prefill, "decode": num_decode}
        now = dict(zip(wanted, self.current()))
        for role, count in wanted.items():
            for _ in range(count - now[role]):
                self.deployment.add_worker(role)
        for role, count in wanted.items():
            for _ in range(now[role] - count):
                self.deployment.remove_worker(role)
