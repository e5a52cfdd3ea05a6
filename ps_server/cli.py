"""``ps-server``: run one parameter server.

    ps-server --mode sync --num-workers 2 --port 50051

Bad flags or a configuration that cannot run give a one-line error and exit
status 2, not a traceback.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from protos import wire

from ps_server.config import ConfigError, ServerConfig
from ps_common.tf_config import TFConfigError


def main(argv: list[str] | None = None) -> int:
    try:
        config = ServerConfig.from_args(argv)
    except (ConfigError, TFConfigError) as e:
        print(f"ps-server: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("ps_server").info("configuration: %s", dataclasses.asdict(config))
    logging.getLogger("ps_server").info(wire.tune_allocator())
    from ps_server.server import serve  # imports grpc; keep --help fast

    try:
        return serve(config)
    except ConfigError as e:
        print(f"ps-server: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
