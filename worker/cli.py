"""``ps-worker``: one training worker.

    ps-worker --ps 127.0.0.1:50051 --worker-index 0 --num-workers 2 --dataset digits --epochs 3

Bad flags, an unreachable server or a mismatched configuration give a one-line
error and a non-zero exit (2 for configuration, 1 for a failed run), not a
traceback.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from protos import wire

from worker.config import ConfigError, WorkerConfig
from ps_common.tf_config import TFConfigError


def main(argv: list[str] | None = None) -> int:
    try:
        config = WorkerConfig.from_args(argv)
    except (ConfigError, TFConfigError) as e:
        print(f"ps-worker: error: {e}", file=sys.stderr)
        return 2
    from worker.client import PSClientError
    from worker.trainer import LOG_TAG, TrainingError, train

    LOG_TAG.index = config.worker_index  # "worker?" until the server assigns it (--worker-index auto)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(worker)s: %(message)s",
        stream=sys.stderr,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(LOG_TAG)
    logging.getLogger("worker").info("configuration: %s", dataclasses.asdict(config))
    logging.getLogger("worker").info(wire.tune_allocator())

    try:
        train(config)
    except ConfigError as e:
        print(f"ps-worker: error: {e}", file=sys.stderr)
        return 2
    except (PSClientError, TrainingError) as e:
        who = f"worker {LOG_TAG.index}" if LOG_TAG.index >= 0 else "worker (no index assigned yet)"
        print(f"ps-worker: error: {who}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ps-worker: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
