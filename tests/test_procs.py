"""ps_common.procs.dying_with_parent: children die with their parent, and starting
them runs no fork handlers (a fork after gRPC was used can hang in gRPC's)."""

import os
import subprocess
import sys
import textwrap
import time

from ps_common.procs import dying_with_parent


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_keeps_its_pid_runs_the_command_and_dies_when_its_parent_is_killed(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from ps_common.procs import dying_with_parent
        child = subprocess.Popen(dying_with_parent(["sleep", "120"]))
        print(child.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 10
        while not open(f"/proc/{pid}/cmdline").read().startswith("sleep"):  # the shim exec'd in place
            assert time.monotonic() < deadline, "the shim never exec'd the command"
            time.sleep(0.05)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()


def test_starting_a_child_runs_no_fork_handlers(tmp_path):
    marker = tmp_path / "forked"
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys
        sys.path.insert(0, {os.getcwd()!r})
        from ps_common.procs import dying_with_parent
        os.register_at_fork(before=lambda: open({str(marker)!r}, "a").write("x"))
        print(subprocess.run(dying_with_parent(["true"])).returncode)
    """)], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "0", run.stderr
    assert not marker.exists(), "a fork handler ran: the child was started with fork()"


def test_the_exit_status_and_output_are_the_commands_own(tmp_path):
    run = subprocess.run(dying_with_parent([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"]),
                         capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == (3, "hi\n")
