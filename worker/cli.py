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
from ps_server.tf_config import TFConfigError


def main(argv: list[str] | None = None) -> int:
    try:
        config = WorkerConfig.from_args(argv)
    except (ConfigError, TFConfigError) as e:
        print(f"ps-worker: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s worker{config.worker_index}: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("worker").info("configuration: %s", dataclasses.asdict(config))
    logging.getLogger("worker").info(wire.tune_allocator())
    from worker.client import PSClientError
    from worker.trainer import TrainingError, train

    try:
        train(config)
    except ConfigError as e:
        print(f"ps-worker: error: {e}", file=sys.stderr)
        return 2
    except (PSClientError, TrainingError) as e:
        print(f"ps-worker: error: worker {config.worker_index}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ps-worker: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
