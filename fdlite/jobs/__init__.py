"""YAML batch jobs (`fdlite run JOB.yaml`): schema, input readers, crash-safe output, runner, summary."""

from fdlite.jobs.job_config import JobConfig, JobConfigError, Overrides, load_job
from fdlite.jobs.job_runner import run_job

__all__ = ["JobConfig", "JobConfigError", "Overrides", "load_job", "run_job"]
