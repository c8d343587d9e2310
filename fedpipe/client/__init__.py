"""The client role: package, profile and submit a model; feed data; collect weights."""
from .job import Client, Job, JobFailed, JobStatus

__all__ = ["Client", "Job", "JobFailed", "JobStatus"]
