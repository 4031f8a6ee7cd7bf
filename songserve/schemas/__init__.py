"""Wire models shared by the dispatcher and the worker: the contract in docs/api.md.

Field names and status words are the compatibility surface with existing frontends and with the
reference's workers; do not rename them. By concern:
- ``worker``: dispatcher ↔ worker (``/generate``, ``/generate_batch``, ``/health``, ``/config``, tasks);
- ``announce``: workers that join a dispatcher (``POST /workers``);
- ``client``: the dispatcher's client routes (``POST /generate``, the job view);
- ``continuation``: continuing a song (``ContinueFrom``, and ``PrefixCodes``, the code grid a
  worker continues from);
- ``uploads``: a person's own audio (``UploadView``, ``UploadStatus``; a worker's ``WorkerEncodeResult``) and
  a key's own LoRA adapters (``AdapterView``);
- ``common``: the patterns that bound names and ids, and a percent.
Everything is re-exported here: importers name ``songserve.schemas`` only. Beside the models,
``body_fields`` is how ``client``'s request models keep a body's fields as sent and its unknown
names, bounded (no wire model: its importers name it).
"""

from __future__ import annotations

from songserve.schemas.announce import WorkerAnnounced, WorkerAnnouncement
from songserve.schemas.client import (
    MAX_WAIT_SEC,
    AceStepExtras,
    GenerateAccepted,
    GenerateRequest,
    JobAsked,
    JobList,
    JobListItem,
    JobView,
    KeyLimits,
    TrackFiles,
    TrackView,
    UsageView,
    WebhookEventName,
)
from songserve.schemas.common import (
    FILE_NAME_PATTERN,
    ID_PATTERN,
    JOB_ID_PATTERN,
    MAX_SEED,
    NO_CONTROL,
    SHA256_PATTERN,
    WORD_PATTERN,
    Percent,
)
from songserve.schemas.continuation import CODEBOOK_SIZE, MAX_PREFIX_FRAMES, ContinueFrom, PrefixCodes
from songserve.schemas.uploads import AdapterView, UploadStatus, UploadView, WorkerEncodeResult
from songserve.schemas.worker import (
    ErrorKind,
    ResultFile,
    TakeHealth,
    TaskState,
    TaskView,
    WorkerBatchRequest,
    WorkerBatchResult,
    WorkerConfig,
    WorkerGenerateRequest,
    WorkerGenerateResult,
    WorkerHealth,
    WorkerPhase,
    WorkerStatus,
    WorkerTakeFailure,
)

__all__ = [
    "CODEBOOK_SIZE",
    "FILE_NAME_PATTERN",
    "ID_PATTERN",
    "JOB_ID_PATTERN",
    "MAX_PREFIX_FRAMES",
    "MAX_SEED",
    "MAX_WAIT_SEC",
    "NO_CONTROL",
    "SHA256_PATTERN",
    "WORD_PATTERN",
    "AceStepExtras",
    "ContinueFrom",
    "ErrorKind",
    "GenerateAccepted",
    "GenerateRequest",
    "JobAsked",
    "JobList",
    "JobListItem",
    "JobView",
    "KeyLimits",
    "Percent",
    "PrefixCodes",
    "ResultFile",
    "TakeHealth",
    "TaskState",
    "TaskView",
    "TrackFiles",
    "TrackView",
    "UsageView",
    "WebhookEventName",
    "UploadStatus",
    "UploadView",
    "AdapterView",
    "WorkerAnnounced",
    "WorkerAnnouncement",
    "WorkerBatchRequest",
    "WorkerBatchResult",
    "WorkerConfig",
    "WorkerEncodeResult",
    "WorkerGenerateRequest",
    "WorkerGenerateResult",
    "WorkerHealth",
    "WorkerPhase",
    "WorkerStatus",
    "WorkerTakeFailure",
]
