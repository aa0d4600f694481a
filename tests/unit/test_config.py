"""Config: flags, comma lists, bootstrap ports, file, env precedence and errors."""

import pytest

from gateway.config import ConfigError, load_config, replica_id_from_pod_name

BASE = ["--prefill", "http://p1:30000", "--decode", "http://d1:30001"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--prefill", "http://p1:30000", "8999"], [("http://p1:30000", 8999)]),
        (["--prefill", "http://p1:30000"], [("http://p1:30000", None)]),
        (["--prefill", "http://p1:30000,http://p2:30000"],
         [("http://p1:30000", None), ("http://p2:30000", None)]),
        (["--prefill", "http://p1:30000", "9001", "--prefill", "http://p2:30000", "none"],
         [("http://p1:30000", 9001), ("http://p2:30000", None)]),
        (["--prefill", "http://[::1]:30000", "8998"], [("http://[::1]:30000", 8998)]),
        (["--prefill", "http://p1:30000/"], [("http://p1:30000", None)]),
    ],
    ids=["url-port", "url-only", "comma-list", "repeated-with-none", "ipv6", "trailing-slash"],
)
def test_prefill_forms(argv, expected):
    cfg = load_config(argv + ["--decode", "http://d:1"], environ={})
    assert [(s.url, s.bootstrap_port) for s in cfg.prefill] == expected


def test_decode_comma_and_repeat():
    cfg = load_config(["--prefill", "http://p:1", "--decode", "http://d1:2,http://d2:3",
                       "--decode", "http://d3:4"], environ={})
    assert [s.url for s in cfg.decode] == ["http://d1:2", "http://d2:3", "http://d3:4"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--decode", "http://d:1"], "at least one prefill"),
        (["--prefill", "http://p:1"], "at least one prefill"),
        (["--prefill", "ftp://p:1", "--decode", "http://d:1"], "bad server URL"),
        (["--prefill", "http://p:notaport", "--decode", "http://d:1"], "bad server URL"),
        (["--prefill", "http://p:1", "70000", "--decode", "http://d:1"], "out of range"),
        (["--prefill", "http://p:1", "--decode", "d:1"], "not a URL"),
        (BASE + ["--policy", "nope"], "unknown"),
        (BASE + ["--max-attempts", "0"], "max_attempts"),
        (BASE + ["--port", "abc"], "port"),
        (["--prefill", "http://p:1", "--decode", "http://p:1"], "listed twice"),
    ],
    ids=["no-prefill", "no-decode", "bad-scheme", "bad-port", "bootstrap-out-of-range",
         "decode-not-url", "unknown-policy", "zero-attempts", "non-numeric-port", "duplicate"],
)
def test_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_config(argv, environ={})


def test_unknown_flag_exits_2():
    with pytest.raises(SystemExit) as info:
        load_config(BASE + ["--frobnicate"], environ={})
    assert info.value.code == 2


def test_file_env_flag_precedence(tmp_path):
    path = tmp_path / "gw.yaml"
    path.write_text(
        "prefill:\n  - url: http://p1:30000\n    bootstrap_port: 9000\n"
        "decode: [http://d1:30001]\nport: 9100\nmax_attempts: 5\nconnect_timeout: 2\n"
    )
    cfg = load_config(["--config", str(path), "--max-attempts", "2"],
                      environ={"GATEWAY_PORT": "9200"})
    assert cfg.prefill[0].bootstrap_port == 9000
    assert cfg.decode[0].url == "http://d1:30001"
    assert cfg.port == 9200  # env beats file
    assert cfg.max_attempts == 2  # flag beats file
    assert cfg.connect_timeout == 2.0


def test_toml_file_and_unknown_key(tmp_path):
    good = tmp_path / "gw.toml"
    good.write_text('prefill = ["http://p:1"]\ndecode = ["http://d:2"]\npolicy = "random"\n')
    assert load_config(["--config", str(good)], environ={}).policy == "random"
    bad = tmp_path / "bad.toml"
    bad.write_text('prefill = ["http://p:1"]\ndecode = ["http://d:2"]\nfoo = 1\n')
    with pytest.raises(ConfigError, match="unknown setting 'foo'"):
        load_config(["--config", str(bad)], environ={})


@pytest.mark.parametrize(
    "name, expected",
    [("gateway-3", 3), (None, None), ("gateway-7f9c-xk2", None)],
    ids=["statefulset-ordinal", "no-name", "deployment-hash"],
)
def test_replica_id_from_pod_name(name, expected):
    got = replica_id_from_pod_name(name)
    if expected is None and name is not None:
        assert 0 <= got < 4096
    else:
        assert got == expected
