"""``ps-server``: run one parameter server.

    ps-server --mode sync --num-workers 2 --port 50051
    ps-server --print-config          # the resolved configuration as JSON, then exit 0

Bad flags or a configuration that cannot run (a bad ``TF_CONFIG`` included) give
a one-line error and exit status 2, not a traceback. The first INFO line says
what this server is (``sync, 2 workers, listening on 127.0.0.1:50051 (TLS off,
token off, reflection on)``); the resolved configuration is logged at DEBUG.
"""

from __future__ import annotations

import logging
import sys

from protos import wire
from ps_common.logs import configure_logging
from ps_common.settings import command_config, to_json
from ps_server.config import ConfigError, ServerConfig


def main(argv: list[str] | None = None) -> int:
    config = command_config(ServerConfig, argv, "ps-server")
    configure_logging(config.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ps_server").debug("configuration: %s", to_json(config, indent=None))
    wire.use_max_message_mb(config.max_message_mb)
    from ps_server.server import serve  # imports grpc; keep --help and --print-config fast

    try:
        return serve(config)
    except ConfigError as e:
        print(f"ps-server: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
