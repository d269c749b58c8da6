"""Deployment profiles: which Dagster executor runs the steps, and where each step may go.

A profile is chosen by name with $UPDATELENS_PROFILE (or `updatelens run --profile`), read when
the code location loads, so the webserver, the daemon, the launching process and every worker
build the same Definitions:

- `local`   one machine. Jobs launched from the UI use Dagster's multiprocess executor (each
            step in its own process); `updatelens run` runs a model's layer range as one
            in-process run (one model load and one capture for all layers: fastest on one box).
- `celery`  dagster-celery with a Redis broker: every (model, layer) partition is its own run,
            and each step is a Celery task on a queue: `gpu` for the steps that load the model
            (activations, functional_metrics), `cpu` for the light ones (local_fits, residuals,
            geometry). Workers subscribe to the queues their host can serve.
- `k8s`     dagster-k8s's `k8s_job_executor`: each step a Kubernetes Job; the model steps
            request a GPU (`nvidia.com/gpu: 1`), the light ones only CPU and memory.

The routing is declared once, on the assets (`assets/routing.step_tags`): a Celery queue tag and a Kubernetes
resource request per step, which each executor reads and the others ignore.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import dagster as dg

from updatelens.errors import ConfigError

PROFILE_ENV = "UPDATELENS_PROFILE"
BROKER_ENV = "UPDATELENS_CELERY_BROKER"
BACKEND_ENV = "UPDATELENS_CELERY_BACKEND"
DEFAULT_BROKER = "redis://127.0.0.1:6379/0"
DEFAULT_BACKEND = "redis://127.0.0.1:6379/1"
# Environment every step needs wherever it runs: where the data lives and how to reach it.
FORWARDED_ENV = ("UPDATELENS_DATA", "UPDATELENS_STORAGE_OPTIONS", "UPDATELENS_PROFILE", "HF_HUB_OFFLINE",
                 "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")


@dataclass(frozen=True)
class Profile:
    name: str
    per_layer_runs: bool  # `updatelens run` launches one run per (model, layer) instead of one per range


# what each profile means: the module docstring
PROFILES = {
    "local": Profile("local", per_layer_runs=False),
    "celery": Profile("celery", per_layer_runs=True),
    "k8s": Profile("k8s", per_layer_runs=True),
}


def active_profile(name: str | None = None) -> Profile:
    chosen = name or os.environ.get(PROFILE_ENV) or "local"
    if chosen not in PROFILES:
        raise ConfigError(f"unknown deployment profile {chosen!r} (${PROFILE_ENV}); choose one of {sorted(PROFILES)}")
    return PROFILES[chosen]


def celery_config() -> dict[str, object]:
    """The celery executor's config; the workers' app (orchestration.celery_app) reads the same."""
    return {
        "broker": os.environ.get(BROKER_ENV, DEFAULT_BROKER),
        "backend": os.environ.get(BACKEND_ENV, DEFAULT_BACKEND),
        "include": ["updatelens.orchestration.definitions"],
        # a worker takes one step at a time (a model step holds a whole model in memory); a step
        # is acknowledged when done, so a worker lost mid-step hands it to another, after Redis's
        # visibility timeout, raised to 12 h so that a long step is never handed out twice
        "config_source": {"worker_prefetch_multiplier": 1, "task_acks_late": True,
                          "broker_connection_retry_on_startup": True,
                          "broker_transport_options": {"max_retries": 3, "interval_start": 0, "interval_step": 0.2,
                                                       "interval_max": 0.5, "visibility_timeout": 43200}},
    }


def k8s_config() -> dict[str, object]:
    config: dict[str, object] = {
        "job_namespace": os.environ.get("UPDATELENS_K8S_NAMESPACE", "updatelens"),
        "env_vars": list(FORWARDED_ENV),
        "max_concurrent": int(os.environ.get("UPDATELENS_K8S_MAX_CONCURRENT", "8")),
    }
    image = os.environ.get("UPDATELENS_K8S_IMAGE")
    if image:  # else the image of the run's code location (K8sRunLauncher)
        config["job_image"] = image
    return config


def executor_for(profile: Profile) -> dg.ExecutorDefinition:
    """The executor every job of the code location uses under this profile."""
    if profile.name == "celery":
        from dagster_celery import celery_executor

        return celery_executor.configured(celery_config(), name="celery")
    if profile.name == "k8s":
        from dagster_k8s import k8s_job_executor

        return k8s_job_executor.configured(k8s_config(), name="k8s")
    return dg.multiprocess_executor.configured({"max_concurrent": os.cpu_count() or 1}, name="multiprocess")
