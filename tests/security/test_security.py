"""TLS, mutual TLS and the bearer token, over a real server on 127.0.0.1 port 0.

    python -m pytest tests/security -q

Rules checked (issue: security; ps_common/security.py):
- "TLS (server certificate; optional mutual TLS with client certificates)": a client
  trusting the CA works, a plaintext client or one trusting another CA is refused;
  with mutual TLS a client without a certificate signed by the CA is refused;
- "with auth configured, a call without the token gets UNAUTHENTICATED and changes
  nothing": every tfps call, missing or wrong token, pulled bytes and version and
  membership unchanged; the health check answers without the token;
- "Secrets come from files or environment variables, never from flags": load_token,
  and the token never appears in the server's log;
- "The docs show how to make a test certificate": the certificates used here are
  made by running the openssl lines of docs/security.md.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import tfps_pb2 as pb
from protos import tfps_pb2_grpc as pb_grpc
from protos import wire
from ps_common import security
from ps_server.config import ServerConfig
from ps_server.server import build_server
from ps_common.settings import ConfigError
from tests.cluster.conftest import port_of, procs, read_log, wait_exit  # noqa: F401 (procs is a fixture)
from worker.client import PSClient, PSClientError

Code = grpc.StatusCode
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "s3cret-token-0123456789abcdef"
W0 = {"w": np.array([1.0, 2.0, 4.0], np.float32)}
SGD = {"name": "sgd", "learning_rate": 0.5}
GRAD = {"w": np.array([2.0, 2.0, 2.0], np.float32)}
W1 = np.array([0.0, 1.0, 3.0], np.float32)  # W0 - 0.5 * GRAD, exact in float32
# Long enough for a slow machine; short enough that a refused handshake, retried by the
# channel's service config, does not hold a test for long.
TIMEOUT = 10.0


# -- fixtures ----------------------------------------------------------------------
def _docs_pki_lines() -> str:
    text = open(os.path.join(ROOT, "docs", "security.md")).read()
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if "openssl req -x509" in b]
    assert len(blocks) == 1, "docs/security.md should have one sh block that makes the test certificates"
    return blocks[0]


def _make_pki(directory) -> dict[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    run = subprocess.run(["sh", "-e", "-c", _docs_pki_lines()], cwd=directory, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    names = ("ca.crt", "server.crt", "server.key", "client.crt", "client.key", "token")
    return {n.replace(".", "_"): str(directory / n) for n in names}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The CA of docs/security.md, its server certificate (localhost, 127.0.0.1), client certificate, token."""
    return _make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory):
    """The same lines run again: a second, unrelated CA."""
    return _make_pki(tmp_path_factory.mktemp("other-pki"))


@pytest.fixture
def serve():
    """``serve(**ServerConfig fields) -> RunningServer`` on 127.0.0.1 port 0; stopped at teardown."""
    started = []

    def start(**fields):
        running = build_server(ServerConfig(host="127.0.0.1", port=0, mode="async", **fields)).start()
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop(grace=0.5)


@pytest.fixture
def client():
    """``client(running, **PSClient keywords) -> PSClient``; closed at teardown."""
    made = []

    def make(running, **kwargs):
        c = PSClient(running.address, timeout=TIMEOUT, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


def refused(code: Code, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except PSClientError as e:
        got, details = e.code, e.details
    except grpc.RpcError as e:
        got, details = e.code(), e.details()
    else:
        pytest.fail(f"expected {code.name}, but the call succeeded")
    assert got == code, f"expected {code.name}, got {got.name}: {details}"
    return details


def handshake_refused(c: PSClient) -> None:
    """A refused TLS handshake surfaces as UNAVAILABLE. Push is not retried by the
    channel's retry policy, so it shows the refusal at once."""
    refused(Code.UNAVAILABLE, c.push, 0, 0, 0, 1, GRAD)


def train_one_step(c: PSClient) -> None:
    """Register, initialize, push once, pull: the server holds W1 at version 1."""
    reg = c.register(worker_index=0, num_workers=1, timeout=TIMEOUT)
    assert c.initialize(reg.worker_id, W0, SGD)
    reply = c.push(reg.worker_id, 0, 0, 4, GRAD)
    version, values = c.pull(reg.worker_id)
    assert reply.version == version == 1
    np.testing.assert_array_equal(values["w"], W1)


def state(running, c: PSClient) -> tuple:
    """What "changes nothing" compares: pulled bytes, version, pushes, members."""
    version, values = c.pull()
    status = running.core.status()
    members = [(w.worker_id, w.name, w.registered_at, w.pushes, w.left) for w in status.workers]
    return version, {k: v.tobytes() for k, v in values.items()}, status.pushes_applied, members


# -- TLS ---------------------------------------------------------------------------
def test_tls_client_trusting_the_ca_registers_initializes_pushes_and_pulls(pki, serve, client):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"])
    train_one_step(client(running, tls_ca_file=pki["ca_crt"]))


def test_plaintext_client_against_a_tls_server_is_unavailable(pki, serve, client):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"])
    handshake_refused(client(running))


def test_tls_client_trusting_another_ca_is_unavailable(pki, other_pki, serve, client):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"])
    handshake_refused(client(running, tls_ca_file=other_pki["ca_crt"]))


def test_tls_server_name_is_the_name_checked_against_the_certificate(pki, serve, client):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"])
    assert client(running, tls_ca_file=pki["ca_crt"], tls_server_name="localhost").status().version == 0
    handshake_refused(client(running, tls_ca_file=pki["ca_crt"], tls_server_name="elsewhere.example"))


def test_mutual_tls_refuses_a_client_without_a_certificate(pki, serve, client):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"], tls_client_ca_file=pki["ca_crt"])
    handshake_refused(client(running, tls_ca_file=pki["ca_crt"]))


def test_mutual_tls_refuses_a_client_certificate_from_another_ca(pki, other_pki, serve, client):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"], tls_client_ca_file=pki["ca_crt"])
    c = client(running, tls_ca_file=pki["ca_crt"], tls_cert_file=other_pki["client_crt"],
               tls_key_file=other_pki["client_key"])
    handshake_refused(c)


def test_mutual_tls_accepts_a_client_certificate_signed_by_the_ca(pki, serve, client):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"], tls_client_ca_file=pki["ca_crt"])
    train_one_step(client(running, tls_ca_file=pki["ca_crt"], tls_cert_file=pki["client_crt"],
                          tls_key_file=pki["client_key"]))


@pytest.mark.parametrize("field, content, message", [
    ("tls_cert_file", None, "cannot read --tls-cert-file"),
    ("tls_cert_file", "not a certificate\n", "--tls-cert-file"),
    ("tls_key_file", "not a key\n", "--tls-key-file"),
    ("tls_client_ca_file", None, "cannot read --tls-client-ca-file"),
])
def test_unreadable_or_non_pem_server_files_are_config_errors(pki, tmp_path, field, content, message):
    files = {"tls_cert_file": pki["server_crt"], "tls_key_file": pki["server_key"]}
    bad = tmp_path / "bad.pem"
    if content is not None:
        bad.write_text(content)
    files[field] = str(bad)
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_server(ServerConfig(host="127.0.0.1", port=0, **files))


# -- the bearer token -----------------------------------------------------------------
def _each_call(c: PSClient):
    return [
        ("Register", lambda: c.register(worker_index=0, num_workers=1, timeout=TIMEOUT)),
        ("Initialize", lambda: c.initialize(0, {"w": np.zeros(3, np.float32)}, SGD)),
        ("Pull", lambda: c.pull(0)),
        ("Push", lambda: c.push(0, 1, 1, 4, GRAD)),  # on the client's session stream, as Work
        ("Work", lambda: c.work(0, timeout=TIMEOUT)),
        ("Leave", lambda: c.leave(0)),
        ("Status", c.status),
    ]


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["missing", "wrong"])
def test_every_call_without_the_right_token_is_unauthenticated_and_changes_nothing(serve, client, token_file, token):
    running = serve(auth_token_file=token_file)
    good = client(running, token=TOKEN)
    train_one_step(good)
    before = state(running, good)
    bad = client(running, token=token)
    for name, call in _each_call(bad):
        details = refused(Code.UNAUTHENTICATED, call)
        assert "token" in details, (name, details)
        assert TOKEN not in details
    assert state(running, good) == before


def test_right_token_trains_and_health_check_needs_no_token(serve, client, token_file):
    running = serve(auth_token_file=token_file)
    assert client(running).health() == "SERVING"
    client(running).wait_ready(TIMEOUT)
    train_one_step(client(running, token=TOKEN))


def test_health_watch_is_not_exempt(serve, token_file):
    """Only the unary Check is exempt: an open Watch stream would hold a handler thread."""
    running = serve(auth_token_file=token_file)
    with grpc.insecure_channel(running.address) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT)
        refused(Code.UNAUTHENTICATED, next, stream)


@pytest.mark.parametrize("metadata, code", [
    ((("authorization", f"Bearer {TOKEN}"),), Code.OK),
    ((("authorization", f"bearer {TOKEN}"),), Code.OK),  # the scheme is case-insensitive (RFC 7235)
    ((("authorization", TOKEN),), Code.UNAUTHENTICATED),  # no scheme
    ((("authorization", f"Basic {TOKEN}"),), Code.UNAUTHENTICATED),
    ((("authorization", f"Bearer {TOKEN}x"),), Code.UNAUTHENTICATED),
    ((("authorization", f"Bearer {TOKEN[:-1]}"),), Code.UNAUTHENTICATED),
    ((("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer other")), Code.UNAUTHENTICATED),
], ids=["bearer", "lowercase_scheme", "no_scheme", "basic", "longer", "shorter", "two_tokens"])
def test_authorization_header_must_be_exactly_one_bearer_with_the_token(serve, token_file, metadata, code):
    running = serve(auth_token_file=token_file)
    with grpc.insecure_channel(running.address, options=wire.channel_options()) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        if code == Code.OK:
            assert stub.Status(pb.StatusRequest(), metadata=metadata, timeout=TIMEOUT).version == 0
        else:
            refused(code, stub.Status, pb.StatusRequest(), metadata=metadata, timeout=TIMEOUT)


def test_token_over_tls_travels_as_call_credentials(pki, serve, client, token_file):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"], auth_token_file=token_file)
    refused(Code.UNAUTHENTICATED, client(running, tls_ca_file=pki["ca_crt"]).status)
    train_one_step(client(running, tls_ca_file=pki["ca_crt"], token=TOKEN))


def test_server_reads_the_token_from_the_environment(serve, client, monkeypatch):
    monkeypatch.setenv("TFPS_AUTH_TOKEN", TOKEN)
    running = serve()
    refused(Code.UNAUTHENTICATED, client(running).status)
    assert client(running, token=TOKEN).status().version == 0


def test_the_token_never_appears_in_the_log(serve, client, token_file, caplog):
    caplog.set_level(logging.DEBUG)
    running = serve(auth_token_file=token_file)
    train_one_step(client(running, token=TOKEN))
    refused(Code.UNAUTHENTICATED, client(running, token="wrong-token-zzz").status)
    refused(Code.UNAUTHENTICATED, client(running).status)
    text = caplog.text
    assert "(TLS off, token on, reflection on)" in text  # the start line says auth is on ...
    assert "rejected /tfps.v1.ParameterServer/Status" in text  # ... and rejections are logged
    assert "clear text" in text  # token without TLS: the client warns
    assert TOKEN not in text and "wrong-token-zzz" not in text


def test_server_start_line_names_tls_mutual_tls_and_auth(pki, serve, token_file, caplog):
    """The first INFO line of a server says what guards it (ps_server.server.describe)."""
    caplog.set_level(logging.INFO, logger="ps_server")
    ports = [serve().port,
             serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"]).port,
             serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"], tls_client_ca_file=pki["ca_crt"],
                   auth_token_file=token_file).port]
    lines = [r.getMessage() for r in caplog.records if r.name == "ps_server" and "listening on" in r.getMessage()]
    assert lines == [f"async, 1 worker, listening on 127.0.0.1:{ports[0]} (TLS off, token off, reflection on)",
                     f"async, 1 worker, listening on 127.0.0.1:{ports[1]} (TLS on, token off, reflection on)",
                     f"async, 1 worker, listening on 127.0.0.1:{ports[2]} (mutual TLS, token on, reflection on)"]


# -- load_token ----------------------------------------------------------------------
def test_load_token_from_a_file_strips_the_trailing_newline(token_file):
    assert security.load_token(token_file, {}) == TOKEN


def test_load_token_from_the_environment():
    assert security.load_token("", {"TFPS_AUTH_TOKEN": f" {TOKEN}\n"}) == TOKEN


def test_load_token_file_wins_over_the_environment(token_file):
    assert security.load_token(token_file, {"TFPS_AUTH_TOKEN": "from-env"}) == TOKEN


def test_load_token_without_file_or_environment_is_none():
    assert security.load_token("", {}) is None
    assert security.load_token(None, {"TFPS_AUTH_TOKEN": ""}) is None  # empty TFPS_* counts as unset


@pytest.mark.parametrize("content", ["", "\n", "   \n"], ids=["empty", "newline", "blanks"])
def test_load_token_rejects_an_empty_token_file(tmp_path, content):
    path = tmp_path / "token"
    path.write_text(content)
    with pytest.raises(ConfigError, match="empty"):
        security.load_token(str(path), {})


def test_load_token_rejects_a_blank_environment_token():
    with pytest.raises(ConfigError, match="TFPS_AUTH_TOKEN is empty"):
        security.load_token("", {"TFPS_AUTH_TOKEN": "  "})


def test_load_token_rejects_a_token_with_inner_spaces():
    with pytest.raises(ConfigError, match="printable ASCII without spaces"):
        security.load_token("", {"TFPS_AUTH_TOKEN": "two words"})


def test_load_token_names_an_unreadable_file(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=re.escape(f"cannot read --auth-token-file '{missing}'")):
        security.load_token(str(missing), {})


def test_load_token_warns_about_a_file_others_can_read(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="ps_common.security"):
        assert security.load_token(str(path), {}) == TOKEN
    assert "can be read by other users" in caplog.text and TOKEN not in caplog.text


# -- processes started by hand ---------------------------------------------------------
def _script(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else shutil.which(name)


@pytest.mark.cluster
def test_readme_secure_commands_train_and_a_worker_without_the_token_is_refused(pki, procs, tmp_path, monkeypatch):
    """ps-server with TLS, mutual TLS and --auth-token-file; ps-worker with TFPS_AUTH_TOKEN."""
    token = open(pki["token"]).read().strip()
    port_file = tmp_path / "port"
    server = procs.start([_script("ps-server"), "--mode", "sync", "--num-workers", "1", "--port", "0",
                          "--port-file", str(port_file), "--tls-cert-file", pki["server_crt"],
                          "--tls-key-file", pki["server_key"], "--tls-client-ca-file", pki["ca_crt"],
                          "--auth-token-file", pki["token"]], "ps")
    address = f"127.0.0.1:{port_of(server, port_file)}"
    tls = ["--tls-ca-file", pki["ca_crt"], "--tls-cert-file", pki["client_crt"], "--tls-key-file", pki["client_key"]]
    common = ["--ps", address, "--num-workers", "1", "--dataset", "synthetic", "--steps", "3",
              "--connect-timeout", "30", *tls]
    monkeypatch.delenv("TFPS_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("TFPS_AUTH_TOKEN_FILE", raising=False)
    intruder = procs.start([_script("ps-worker"), *common, "--worker-index", "0"], "intruder")
    monkeypatch.setenv("TFPS_AUTH_TOKEN", token)
    result = tmp_path / "result.json"
    worker = procs.start([_script("ps-worker"), *common, "--worker-index", "0", "--result-json", str(result)],
                         "worker0")
    assert wait_exit(worker, 600) == 0, read_log(worker)[-3000:]
    assert result.exists()
    assert wait_exit(intruder, 600) == 1, read_log(intruder)[-3000:]
    errors = [line for line in read_log(intruder).splitlines() if ": error:" in line]
    assert len(errors) == 1 and "UNAUTHENTICATED" in errors[0] and "Traceback" not in read_log(intruder), errors
    server.send_signal(15)
    assert wait_exit(server, 30) == 0, read_log(server)
    server_log = read_log(server)
    assert f"listening on 127.0.0.1:{address.rsplit(':', 1)[1]} (mutual TLS, token on, reflection on)" in server_log
    assert token not in server_log and token not in read_log(worker)


def test_ps_launch_refuses_tls_flags_with_a_one_line_error(capsys):
    from ps_tools import launch

    assert launch.main(["--workers", "1", "--tls-ca-file", "ca.crt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ps-launch: error: ps-launch runs every process on loopback without TLS" in err[0]
