"""The Celery app the workers run: `celery -A orchestration.celery_app worker -Q gpu,cpu ...`.

dagster-celery's own app (`dagster_celery.app`) declares only its `dagster` queue. The executor
publishes each step to the exchange named after the step's queue with the routing key
`<queue>.execute_plan`, and a queue a worker creates from `-Q` is bound with the key `<queue>`,
so steps tagged for another queue never arrive (seen here with Redis: the workers idled). This
app, built the way dagster-celery documents for a custom broker, declares the `gpu` and `cpu`
queues (and `dagster`) bound with the keys the executor publishes with. Broker and backend come
from the same environment as the executor's config (orchestration.deployments.celery_config).
"""

from __future__ import annotations

from dagster_celery.executor import CeleryExecutor
from dagster_celery.make_app import make_app
from dagster_celery.tasks import create_execute_job_task, create_resume_job_task, create_task
from kombu import Exchange, Queue

from updatelens.assets.routing import CPU_QUEUE, GPU_QUEUE
from updatelens.orchestration.deployments import celery_config

QUEUES = (GPU_QUEUE, CPU_QUEUE, "dagster")


def make_worker_app():
    config = celery_config()
    app = make_app(CeleryExecutor.for_cli(broker=config["broker"], backend=config["backend"],
                                          include=config["include"], config_source=config["config_source"]).app_args())
    app.conf.task_queues = [Queue(name, Exchange(name, type="direct"), routing_key=f"{name}.execute_plan")
                            for name in QUEUES]
    return app


app = make_worker_app()
execute_plan = create_task(app)
execute_job = create_execute_job_task(app)
resume_job = create_resume_job_task(app)
