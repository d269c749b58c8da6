"""Where each step may run: a Celery queue tag and a Kubernetes resource request per step.

Declared on the assets themselves; each executor of a deployment profile (orchestration/deployments)
reads the tag meant for it and the others ignore it.
"""

from __future__ import annotations

MODEL_POOL = "model"  # the Dagster pool of the steps that hold a model (limited to one slot per machine)
GPU_QUEUE = "gpu"
CPU_QUEUE = "cpu"
CELERY_QUEUE_TAG = "dagster-celery/queue"  # dagster_celery.tags.DAGSTER_CELERY_QUEUE_TAG
K8S_CONFIG_TAG = "dagster-k8s/config"  # dagster_k8s.job.USER_DEFINED_K8S_CONFIG_KEY


def step_tags(needs_model: bool) -> dict[str, object]:
    """Where a step may run: the Celery queue, and the Kubernetes resources of its pod."""
    if needs_model:
        resources = {"requests": {"cpu": "2", "memory": "16Gi", "nvidia.com/gpu": "1"},
                     "limits": {"memory": "32Gi", "nvidia.com/gpu": "1"}}
    else:
        resources = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}
    return {CELERY_QUEUE_TAG: GPU_QUEUE if needs_model else CPU_QUEUE,
            K8S_CONFIG_TAG: {"container_config": {"resources": resources}}}
