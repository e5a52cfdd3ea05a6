"""``--ps`` takes one HOST:PORT or a comma-separated list of server shards.

    python -m pytest -q tests/worker/test_config_ps.py
"""

import pytest

from ps_common.settings import ConfigError
from worker.config import WorkerConfig


def config(ps: str) -> WorkerConfig:
    return WorkerConfig.from_args(["--ps", ps], environ={})


def test_one_address_is_one_server():
    assert config("10.0.0.1:50051").ps_addresses == ["10.0.0.1:50051"]


def test_a_comma_separated_list_names_the_shards_in_order():
    assert config("a:1, b:2,c:3").ps_addresses == ["a:1", "b:2", "c:3"]


def test_a_bad_single_address_keeps_its_message():
    with pytest.raises(ConfigError, match=r"^--ps must be HOST:PORT, got 'nohost'$"):
        config("nohost")


@pytest.mark.parametrize("ps, expected", [
    ("a:1,b", "(entry 2 is 'b')"),
    ("a:1,", "(entry 2 is '')"),
    ("a:1,b:x", "(entry 2 is 'b:x')"),
    ("a:1,b:2,a:1", "--ps lists a:1 more than once"),
])
def test_a_bad_list_names_the_entry(ps, expected):
    with pytest.raises(ConfigError) as e:
        config(ps)
    assert expected in str(e.value) and repr(ps) in str(e.value)
