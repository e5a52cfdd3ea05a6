#!/bin/sh
# tfps-entrypoint PROGRAM [ARG...]: the ENTRYPOINT of the tfps images.
#
# With no arguments, or when the first one is a flag, runs PROGRAM with them
# (docker run tfps-server --mode sync); otherwise runs the arguments as a command
# (docker run tfps-worker python -c "import worker"). exec: the process gets the
# container's signals directly.
set -eu
prog="$1"
shift
case "${1:-}" in
    "" | -*) exec "$prog" "$@" ;;
    *) exec "$@" ;;
esac
