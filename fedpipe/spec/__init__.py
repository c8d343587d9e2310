"""The job's vocabulary: schedules, the codec grammar, job states, DiLoCo settings, JobSpec.

Each fact about a job is written here once, and client, tracker, planner,
node and wire read it from here. This package imports neither torch nor grpc
(only the generated protobuf messages), so the tracker's control plane starts
fast and runs on a small machine.

One module per concern, each importing only those above it in this list:

- :mod:`.errors`: :class:`SpecError`, :class:`JobSpecError`.
- :mod:`.schedules`: schedules as data (:func:`schedule_order`, :func:`async_stream`).
- :mod:`.codecs`: the codec grammar (:func:`parse_codec`) and where a codec may be used.
- :mod:`.states`: a job's states (:data:`TERMINAL`, :func:`state_name`).
- :mod:`.protocol`: the data plane's message kinds (:class:`Kind`) and protocol constants.
- :mod:`.replicas`: how replica groups agree (:class:`DiLoCo`, :class:`Quorum`).
- :mod:`.weights`: where a job's initial weights come from (:class:`WeightsSpec`).
- :mod:`.cuts`: pinned stage boundaries (:func:`cuts_problem`, :func:`stage_ranges`).
- :mod:`.jobspec`: the job's configuration (:class:`JobSpec`, :data:`FIELD_RULES`).
- :mod:`.knobs`: ``submit``'s knob groups (:class:`Training`, ... :class:`Knobs`).
- :mod:`.plans`: questions about a plan message (:class:`PlanView`, :class:`StageKey`,
  :func:`peer_of`).

Every name is importable from ``fedpipe.spec`` itself, as before the split.
"""
from __future__ import annotations

from .codecs import (CODEC_PARAMS, CODEC_POLICIES, GRADIENT_ONLY_CODECS, HADAMARD_CODECS,
                     LOWRANK_CODECS, CodecSpec, check_compression, hadamard_block_problem,
                     lowrank_problem, parse_codec)
from .cuts import cuts_of, cuts_problem, stage_ranges
from .errors import JobSpecError, SpecError
from .jobspec import (FIELD_RULES, MAX_MICROBATCHES, MICROBATCHES, PRECISIONS, REBALANCE,
                      RECOMPUTE, SCHEDULE, JobSpec, check_field, stage_recomputes)
from .knobs import (FLAT_KNOBS, GROUPS, Compression, Group, Knobs, Lifetime, Placement,
                    Replicas, Training)
from .plans import PlanView, StageKey, peer_of
from .protocol import PROTOCOL_VERSION, SNAPSHOTS_KEPT, Kind
from .replicas import REPLICA_SYNCS, DiLoCo, Quorum
from .schedules import (SCHEDULES, SYNC_SCHEDULES, Action, async_stream, check_schedule, gpipe,
                        one_f_one_b, schedule_order)
from .states import (ACTIVE, CLIENT_TIMEOUT, NODE_DRAINED, NODE_LEFT, TERMINAL, WAITING, JobState,
                     state_name)
from .weights import WEIGHT_SOURCES, WeightsSpec

__all__ = [
    "ACTIVE", "CLIENT_TIMEOUT", "CODEC_PARAMS", "CODEC_POLICIES", "FIELD_RULES", "FLAT_KNOBS",
    "GRADIENT_ONLY_CODECS", "GROUPS", "HADAMARD_CODECS", "LOWRANK_CODECS", "MAX_MICROBATCHES",
    "MICROBATCHES", "SCHEDULE",
    "NODE_DRAINED", "NODE_LEFT",
    "PRECISIONS", "PROTOCOL_VERSION", "REBALANCE", "RECOMPUTE", "stage_recomputes",
    "REPLICA_SYNCS", "SCHEDULES", "SNAPSHOTS_KEPT", "SYNC_SCHEDULES", "TERMINAL", "WAITING",
    "Action", "CodecSpec", "Compression", "DiLoCo", "Group", "JobSpec", "JobSpecError",
    "JobState", "Kind", "Knobs", "Lifetime", "Placement", "PlanView", "Quorum", "Replicas",
    "SpecError", "StageKey", "Training", "async_stream", "check_compression", "check_field",
    "check_schedule", "cuts_of", "cuts_problem", "gpipe", "hadamard_block_problem",
    "lowrank_problem", "one_f_one_b", "parse_codec", "peer_of", "schedule_order",
    "stage_ranges", "state_name",
    "WEIGHT_SOURCES", "WeightsSpec",
]
