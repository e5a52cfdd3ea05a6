"""docker/healthcheck.py, the images' HEALTHCHECK, against real servers on loopback.

    python -m pytest tests/docker/test_healthcheck.py -q

No container needed: the script is run as the image runs it, with the server's
environment, against a plaintext, a TLS and a mutual-TLS server (the test
certificates of docs/security.md).
"""

import os
import subprocess
import sys


from tests.security.test_security import pki, serve  # noqa: F401 - docs/security.md's certificates; a server on port 0

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "docker", "healthcheck.py")


def check(port: int, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TFPS_")}
    return subprocess.run([sys.executable, SCRIPT], env={**clean, "TFPS_PORT": str(port), **env},
                          capture_output=True, text=True, timeout=60)


def test_plaintext_server_is_healthy(serve):
    run = check(serve().port)
    assert (run.returncode, run.stderr) == (0, "")


def test_no_server_is_unhealthy_with_one_line(serve):
    port = serve().port
    run = check(1)
    assert run.returncode == 1 and run.stderr.strip() == "tfps-healthcheck: 127.0.0.1:1: UNAVAILABLE", run.stderr
    assert check(port).returncode == 0


def test_tls_server_is_healthy_when_the_check_trusts_its_ca(pki, serve):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"])
    tls = {"TFPS_SERVER_TLS_CERT_FILE": pki["server_crt"], "TFPS_SERVER_TLS_KEY_FILE": pki["server_key"]}
    assert check(running.port).returncode == 1  # plaintext against TLS: not healthy
    run = check(running.port, **tls, TFPS_HEALTHCHECK_CA_FILE=pki["ca_crt"])
    assert (run.returncode, run.stderr) == (0, "")
    run = check(running.port, **tls, TFPS_HEALTHCHECK_CA_FILE=pki["ca_crt"], TFPS_HEALTHCHECK_SERVER_NAME="elsewhere")
    assert run.returncode == 1 and "UNAVAILABLE" in run.stderr  # the name is checked


def test_mutual_tls_server_needs_the_check_to_present_a_client_certificate(pki, serve):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"],
                    tls_client_ca_file=pki["ca_crt"])
    env = {"TFPS_SERVER_TLS_CERT_FILE": pki["server_crt"], "TFPS_TLS_CLIENT_CA_FILE": pki["ca_crt"],
           "TFPS_HEALTHCHECK_CA_FILE": pki["ca_crt"]}
    run = check(running.port, **env)
    assert run.returncode == 1 and "set TFPS_HEALTHCHECK_CERT_FILE and TFPS_HEALTHCHECK_KEY_FILE" in run.stderr
    run = check(running.port, **env, TFPS_HEALTHCHECK_CERT_FILE=pki["client_crt"],
                TFPS_HEALTHCHECK_KEY_FILE=pki["client_key"])
    assert (run.returncode, run.stderr) == (0, "")


def test_the_old_shared_certificate_variable_still_works_with_a_one_line_deprecation_warning(pki, serve):
    running = serve(tls_cert_file=pki["server_crt"], tls_key_file=pki["server_key"])
    run = check(running.port, TFPS_TLS_CERT_FILE=pki["server_crt"], TFPS_HEALTHCHECK_CA_FILE=pki["ca_crt"])
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == ["TFPS_TLS_CERT_FILE is deprecated: it meant different things to ps-server "
                                       "and ps-worker; this process reads it as TFPS_SERVER_TLS_CERT_FILE"]


def test_the_port_and_address_come_from_the_server_settings(serve):
    """TFPS_PORT as the server reads it; a server bound to all addresses is checked on 127.0.0.1,
    one bound to a single address on that address."""
    port = serve().port
    assert check(port, TFPS_HOST="0.0.0.0").returncode == 0
    assert check(port, TFPS_HOST="127.0.0.1").returncode == 0
    run = check(port, TFPS_HOST="127.0.0.2")
    assert run.returncode == 1 and run.stderr.strip() == f"tfps-healthcheck: 127.0.0.2:{port}: UNAVAILABLE", run.stderr
    run = check(port, TFPS_PORT="not-a-port")
    assert run.returncode == 1 and run.stderr.strip() == (
        "tfps-healthcheck: the server's environment: TFPS_PORT='not-a-port' is not a valid int"), run.stderr
