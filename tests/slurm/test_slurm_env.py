"""The Slurm environment -> the cluster tfps runs: what ps_common.slurm reads, and the hook.

As TensorFlow's SlurmClusterResolver reads it: SLURM_PROCID, SLURM_STEP_NUM_TASKS,
SLURM_STEP_NODELIST (compressed), SLURM_STEP_TASKS_PER_NODE (``2(x3),1``); the
first TFPS_SLURM_NUM_PS tasks serve at port base + their position on their node,
the others train, worker 0 the chief. No Slurm needed.
"""

import pytest

from ps_common import slurm
from ps_common.settings import ConfigError
from ps_server.config import ServerConfig
from worker.config import WorkerConfig

pytestmark = pytest.mark.slurm


def step(rank: int, **extra) -> dict:
    """A step of 7 tasks on n1, n2, n3 (two each) and m1 (one), as srun sets it."""
    env = {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_NODELIST": "m1,n[1-3]",
           "SLURM_STEP_TASKS_PER_NODE": "1,2(x3)"}
    env.update({k: v for k, v in extra.items() if v is not None})
    return {k: v for k, v in env.items() if v != ""}


def cluster(environ: dict) -> slurm.SlurmCluster:
    return slurm.from_environ(environ, hostnames=slurm.expand_hostlist)


@pytest.mark.parametrize("nodelist, hosts", [
    ("n[1-2],m5,o[3-4,6,7-9]", ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),  # the resolver's example
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),  # zero padding kept
    ("n[9-10]", ["n9", "n10"]),  # Slurm's order, not sorted as strings
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("vm", ["vm"]),
    ("a.example.org,b-2", ["a.example.org", "b-2"]),
])
def test_node_lists_expand_in_slurms_order(nodelist, hosts):
    assert slurm.expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, message", [
    ("", "the Slurm node list is empty"),
    ("n[1-", "'[' without ']'"),
    ("n1]", "']' without '['"),
    ("n[3-1]", "the range '3-1' runs backwards"),
    ("n[a-b]", "'a-b' is not a number or a range N-M"),
    ("a,,b", "an empty name"),
])
def test_a_bad_node_list_is_a_one_line_error(nodelist, message):
    with pytest.raises(slurm.SlurmError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        slurm.expand_hostlist(nodelist)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, counts", [
    ("2(x3),1", [2, 2, 2, 1]),
    ("3(x2),2,1", [3, 3, 2, 1]),  # the resolver's example
    ("4", [4]),
    ("1,1", [1, 1]),
])
def test_tasks_per_node_expand(text, counts):
    assert slurm.expand_tasks_per_node(text) == counts


def test_bad_tasks_per_node_is_a_one_line_error():
    with pytest.raises(slurm.SlurmError, match=r"tasks per node '2x3': '2x3' is not N or N\(xR\)"):
        slurm.expand_tasks_per_node("2x3")


def test_ranks_fill_the_nodes_in_order_with_ports_from_the_base_by_local_position():
    c = cluster(step(0))
    assert c.hosts == ("m1", "n1", "n1", "n2", "n2", "n3", "n3")
    assert c.ports == (8888, 8888, 8889, 8888, 8889, 8888, 8889)
    assert c.addresses[2] == "n1:8889"
    assert (c.role, c.task_index, c.is_chief, c.num_workers) == ("ps", 0, False, 6)
    assert c.ps_addresses == ("m1:8888",)
    assert c.describe() == "Slurm task 0 of 7: ps 0, serving on m1:8888"


def test_the_first_task_after_the_servers_is_the_chief():
    chief, last = cluster(step(1)), cluster(step(6))
    assert (chief.role, chief.task_index, chief.is_chief) == ("worker", 0, True)
    assert chief.describe() == "Slurm task 1 of 7: worker 0 (the chief) on n1"
    assert (last.role, last.task_index, last.is_chief, last.host, last.port) == ("worker", 5, False, "n3", 8889)


def test_several_servers_and_another_port_base():
    c = cluster(step(2, TFPS_SLURM_NUM_PS="3", TFPS_SLURM_PORT_BASE="50051"))
    assert c.ps_addresses == ("m1:50051", "n1:50051", "n1:50052")
    assert (c.role, c.task_index, c.port, c.num_workers) == ("ps", 2, 50052, 4)
    assert cluster(step(3, TFPS_SLURM_NUM_PS="3")).task_index == 0  # worker 0


def test_the_jobs_variables_stand_in_for_the_steps():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "c[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    c = cluster(env)
    assert c.hosts == ("c1", "c1", "c2", "c2") and c.ps_addresses == ("c1:8888",) and c.task_index == 0


def test_one_node_needs_no_tasks_per_node():
    c = cluster({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NODELIST": "vm"})
    assert c.ports == (8888, 8889, 8890) and (c.role, c.task_index) == ("worker", 1)


def test_where_slurm_says_this_task_runs_matches_the_layout():
    assert cluster(step(4, SLURMD_NODENAME="n2", SLURM_LOCALID="1")).port == 8889
    with pytest.raises(slurm.SlurmError, match="Slurm runs task 4 on n3, but a block layout of the node list puts "
                                               "it on n2: start the step with --distribution=block"):
        cluster(step(4, SLURMD_NODENAME="n3"))
    with pytest.raises(slurm.SlurmError, match="as local task 0 on n2, but a block layout makes it local task 1"):
        cluster(step(4, SLURMD_NODENAME="n2", SLURM_LOCALID="0"))


@pytest.mark.parametrize("environ, message", [
    ({}, "SLURM_PROCID is not set: this is not a task of a Slurm step (start it with srun)"),
    (step(0, SLURM_STEP_NUM_TASKS=""), "neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is set"),
    (step(0, SLURM_PROCID="x"), "SLURM_PROCID='x' is not an integer"),
    (step(7), "SLURM_PROCID=7 is not a task of a step of 7 (SLURM_STEP_NUM_TASKS=7)"),
    (step(0, SLURM_STEP_NODELIST=""), "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set"),
    (step(0, SLURM_STEP_TASKS_PER_NODE=""), "SLURM_STEP_TASKS_PER_NODE is not set and SLURM_STEP_NODELIST="
                                            "'m1,n[1-3]' has 4 nodes"),
    (step(0, SLURM_STEP_TASKS_PER_NODE="2(x3)"), "SLURM_STEP_TASKS_PER_NODE='2(x3)' counts 3 nodes but"),
    (step(0, SLURM_STEP_TASKS_PER_NODE="2(x4)"), "places 8 tasks but the step has 7"),
    (step(0, TFPS_SLURM_NUM_PS="7"), "TFPS_SLURM_NUM_PS=7 leaves no task of the 7 to train"),
    (step(0, TFPS_SLURM_NUM_PS="0"), "TFPS_SLURM_NUM_PS='0' must be >= 1"),
    (step(0, TFPS_SLURM_PORT_BASE="65535"), "goes past port 65535"),
])
def test_a_missing_or_bad_slurm_variable_is_a_one_line_config_error(environ, message):
    with pytest.raises(ConfigError) as e:
        cluster(environ)
    assert message in str(e.value) and "\n" not in str(e.value)


# -- the hook: TFPS_CLUSTER=slurm in ps_common.settings -----------------------------------
def test_the_server_gets_its_port_all_interfaces_and_the_worker_count():
    c = ServerConfig.from_args([], environ=step(0, TFPS_CLUSTER="slurm"))
    assert (c.port, c.host, c.num_workers) == (8888, "0.0.0.0", 6)
    assert ServerConfig.from_args(["--port", "9000"], environ=step(0, TFPS_CLUSTER="slurm")).port == 9000


def test_the_worker_gets_every_server_its_index_and_the_worker_count():
    c = WorkerConfig.from_args([], environ=step(5, TFPS_CLUSTER="slurm", TFPS_SLURM_NUM_PS="2"))
    assert (c.ps, c.worker_index, c.num_workers) == ("m1:8888,n1:8888", 3, 5)
    assert c.ps_addresses == ["m1:8888", "n1:8888"]


def test_a_job_that_takes_workers_joining_later_states_its_most_workers_everywhere():
    """TFPS_SLURM_MAX_WORKERS (ps-slurm --max-workers): every --num-workers is the job's most
    workers, not the step's; fewer than the step's is a one-line error."""
    server = ServerConfig.from_args([], environ=step(0, TFPS_CLUSTER="slurm", TFPS_SLURM_MAX_WORKERS="8"))
    worker = WorkerConfig.from_args([], environ=step(3, TFPS_CLUSTER="slurm", TFPS_SLURM_MAX_WORKERS="8"))
    assert (server.num_workers, worker.num_workers, worker.worker_index) == (8, 8, 2)
    assert cluster(step(3, TFPS_SLURM_MAX_WORKERS="8")).num_workers == 6  # the step's own
    with pytest.raises(ConfigError, match="^TFPS_SLURM_MAX_WORKERS=5 is fewer than the step's 6 workers$"):
        cluster(step(3, TFPS_SLURM_MAX_WORKERS="5"))


def test_slurm_replaces_tf_config_and_is_read_only_when_asked_for():
    tf_config = '{"cluster": {"ps": ["p:1"], "worker": ["w:1"]}, "task": {"type": "worker", "index": 0}}'
    assert WorkerConfig.from_args([], environ=step(1, TFPS_CLUSTER="slurm", TF_CONFIG=tf_config)).ps == "m1:8888"
    assert WorkerConfig.from_args([], environ=step(1, TF_CONFIG=tf_config)).ps == "p:1"
    assert WorkerConfig.from_args([], environ=step(1)).ps == "127.0.0.1:50051"  # SLURM_* alone: not read
    assert WorkerConfig.from_args([], environ=step(1, TFPS_CLUSTER="tf_config")).ps == "127.0.0.1:50051"


def test_the_hooks_errors_are_one_line():
    with pytest.raises(ConfigError, match="TFPS_CLUSTER='k8s' must be one of tf_config, slurm"):
        WorkerConfig.from_args([], environ={"TFPS_CLUSTER": "k8s"})
    with pytest.raises(ConfigError, match="Slurm task 0 is ps 0 .TFPS_SLURM_NUM_PS=1., not a worker: run "
                                          "ps-server there, or ps-slurm on every task"):
        WorkerConfig.from_args([], environ=step(0, TFPS_CLUSTER="slurm"))
    with pytest.raises(ConfigError, match="Slurm task 1 is worker 0 .TFPS_SLURM_NUM_PS=1., not a ps: run ps-worker"):
        ServerConfig.from_args([], environ=step(1, TFPS_CLUSTER="slurm"))
    with pytest.raises(ConfigError, match="SLURM_PROCID is not set"):
        ServerConfig.from_args([], environ={"TFPS_CLUSTER": "slurm"})


# -- ps-slurm's own arguments (ps_tools.slurm), without Slurm ----------------------------
def test_ps_slurm_gives_the_servers_exit_when_done_and_the_workers_their_flags():
    from ps_tools.slurm import role_argvs

    assert role_argvs("--mode sync --lease-timeout 2", ["--dataset", "digits"]) == (
        ["--exit-when-done", "--mode", "sync", "--lease-timeout", "2"], ["--dataset", "digits"])


@pytest.mark.parametrize("server_args, worker_argv, message", [
    ("--port 1", [], "--server-args: --port is set from the Slurm environment; leave it out"),
    ("", ["--worker-index", "1", "--num-workers", "2"],
     "ps-worker flags: --worker-index, --num-workers are set from the Slurm environment; leave them out"),
    ("--mode bulk", [], "--server-args: argument --mode: invalid choice: 'bulk'"),
    ("--mode 'sync", [], "--server-args \"--mode 'sync\": No closing quotation"),
    ("", ["--no-such-flag"], "ps-worker flags: unrecognized arguments: --no-such-flag"),
    ("", ["--ps", "a:1"], "ps-worker flags: --ps is set from the Slurm environment; leave it out"),
])
def test_ps_slurm_refuses_what_slurm_decides_and_bad_flags_in_one_line(server_args, worker_argv, message):
    from ps_tools.slurm import SlurmLaunchError, role_argvs

    with pytest.raises(SlurmLaunchError) as e:
        role_argvs(server_args, worker_argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_ps_slurm_outside_slurm_is_a_one_line_error_and_status_2(capsys, monkeypatch):
    from ps_tools import slurm as ps_slurm

    for name in [k for k in __import__("os").environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    assert ps_slurm.main(["--dataset", "digits"]) == 2
    assert capsys.readouterr().err == ("ps-slurm: error: SLURM_PROCID is not set: this is not a task of a Slurm "
                                       "step (start it with srun)\n")


def test_ps_slurm_passes_its_flags_as_the_variables_and_a_signal_as_128_plus_it():
    from ps_tools.slurm import child_environment, exit_status, parser

    args, rest = parser().parse_known_args(["--num-ps", "2", "--port-base", "9000", "--epochs", "1"])
    env = child_environment(args, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "TFPS_CLUSTER": "slurm", "TFPS_SLURM_NUM_PS": "2", "TFPS_SLURM_PORT_BASE": "9000"}
    assert rest == ["--epochs", "1"]
    assert (exit_status(-9), exit_status(1), exit_status(0)) == (137, 1, 0)


def test_ps_slurm_join_makes_every_task_a_worker_of_the_running_job_with_an_index_from_the_server():
    from ps_tools.slurm import join_task, parser

    environ = {**step(2, SLURMD_NODENAME="n9", TFPS_CLUSTER="slurm"), "TF_CONFIG": "{}", "PATH": "/bin"}
    args, rest = parser().parse_known_args(["--join", "n1:8888", "--max-workers", "4", "--elastic", "--epochs", "3"])
    command, env, what = join_task(args, rest, environ)
    assert command[1:] == ["-m", "worker", "--ps", "n1:8888", "--worker-index", "auto", "--num-workers", "4",
                           "--elastic", "--epochs", "3"]
    assert "TFPS_CLUSTER" not in env and "TF_CONFIG" not in env and env["PATH"] == "/bin"  # its cluster is its flags
    assert what == "Slurm task 2 of 7: a worker on n9 joining the job at n1:8888 (its index from the server)"


@pytest.mark.parametrize("argv, message", [
    (["--join", "n1:8888"], "--join needs --max-workers N >= 1, the running job's (got none): every worker states the "
     "servers' --num-workers"),
    (["--join", "n1:8888", "--max-workers", "4", "--server-args", "--mode sync"],
     "--join: every task of this step is a worker; leave out --server-args and --num-ps"),
    (["--join", "n1:8888", "--max-workers", "4", "--worker-index", "3"],
     "ps-worker flags: --worker-index is set from --join and --max-workers; leave it out"),
])
def test_ps_slurm_join_refuses_in_one_line(argv, message):
    from ps_tools.slurm import SlurmLaunchError, join_task, parser

    args, rest = parser().parse_known_args(argv)
    with pytest.raises(SlurmLaunchError) as e:
        join_task(args, rest, step(0))
    assert str(e.value) == message


def test_ps_slurm_records_the_servers_and_the_chiefs_status_for_the_job_script(tmp_path, capsys):
    """tfps.sbatch takes the job's status from these files (srun's counts a worker Slurm killed)."""
    from ps_tools.slurm import record_status

    environ = {"TFPS_SLURM_STATUS": str(tmp_path / ".tfps-7")}
    two = {"TFPS_SLURM_NUM_PS": "2"}
    for rank, status in [(0, 0), (1, 3), (2, 1), (3, 137)]:  # ps 0, ps 1, the chief, worker 1
        record_status(environ, cluster(step(rank, **two)), status)
    record_status({}, cluster(step(2, **two)), 5)  # not asked: nothing written
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {
        ".tfps-7.ps-0": "0\n", ".tfps-7.ps-1": "3\n", ".tfps-7.chief": "1 2\n"}
    record_status({"TFPS_SLURM_STATUS": str(tmp_path / "missing" / "x")}, cluster(step(1)), 0)  # the chief
    assert "cannot record this task's status in" in capsys.readouterr().err
