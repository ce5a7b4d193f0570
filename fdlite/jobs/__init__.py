"""YAML batch jobs (`fdlite run JOB.yaml`): schema, input readers, crash-safe output, runner, summary."""

from fdlite.jobs.job_config import JobConfig, JobConfigError, Overrides, load_job

__all__ = ["JobConfig", "JobConfigError", "Overrides", "load_job", "run_job"]


def __getattr__(name):
    if name == "run_job":  # imported on use: the runner is the only part of a job that needs the engine
        from fdlite.jobs.job_runner import run_job

        return run_job
    raise AttributeError(f"module 'fdlite.jobs' has no attribute {name!r}")
