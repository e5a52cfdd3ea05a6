"""``ps-worker``: one training worker.

    ps-worker --ps 127.0.0.1:50051 --worker-index 0 --num-workers 2 --dataset digits --epochs 3
    ps-worker --print-config          # the resolved configuration as JSON, then exit 0

Bad flags, an unreachable server or a mismatched configuration (a bad
``TF_CONFIG`` included) give a one-line error and a non-zero exit (2 for
configuration, 1 for a failed run), not a traceback. With ``--elastic``, SIGTERM
makes it leave the job and exit 143 (``ps_common.procs.LEFT_JOB_STATUS``,
``worker.elastic``), which ``ps-launch`` tells from a worker that ended without
leaving. The resolved configuration is logged at DEBUG; other libraries log only
their warnings (``ps_common.logs``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import logging
import sys

from protos import wire
from ps_common.logs import configure_logging
from ps_common.procs import LEFT_JOB_STATUS
from ps_common.settings import command_config, to_json
from worker.config import ConfigError, WorkerConfig


def main(argv: list[str] | None = None) -> int:
    # A crash in TensorFlow or gRPC (SIGSEGV, SIGABRT ...) leaves each thread's Python stack on the
    # process's own stderr (fd 2, whatever sys.stderr is now: a test may have replaced it with an object
    # that has no file descriptor).
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):  # no stderr to write to
        faulthandler.enable(file=sys.__stderr__)
    config = command_config(WorkerConfig, argv, "ps-worker")
    allocator = wire.tune_allocator()  # first thing: before TensorFlow allocates
    wire.use_max_message_mb(config.max_message_mb)  # every channel this process opens
    from worker.client import PSClientError
    from worker.elastic import Stopped
    from worker.trainer import LOG_TAG, TrainingError, train

    LOG_TAG.index = config.worker_index  # "worker?" until the server assigns it (--worker-index auto)
    configure_logging(config.log_level, "%(asctime)s %(levelname)s %(worker)s: %(message)s", filters=[LOG_TAG])
    logging.getLogger("worker").debug("configuration: %s", to_json(config, indent=None))
    logging.getLogger("worker").debug(allocator)

    try:
        train(config)
    except ConfigError as e:
        print(f"ps-worker: error: {e}", file=sys.stderr)
        return 2
    except (PSClientError, TrainingError) as e:
        who = f"worker {LOG_TAG.index}" if LOG_TAG.index >= 0 else "worker (no index assigned yet)"
        print(f"ps-worker: error: {who}: {e}", file=sys.stderr)
        return 1
    except Stopped as e:  # --elastic: SIGTERM made it leave the job (worker.elastic)
        print(f"ps-worker: worker {LOG_TAG.index}: {e}", file=sys.stderr)
        return LEFT_JOB_STATUS
    except KeyboardInterrupt:
        print("ps-worker: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
