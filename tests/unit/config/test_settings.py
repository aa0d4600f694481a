"""Config: flags, comma lists, bootstrap ports, file, env precedence and errors."""

import pytest

from gateway.config.settings import ConfigError, load_config, replica_id_from_pod_name

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


@pytest.mark.parametrize(
    "flags, setting, allowed",
    [
        (["--max-body-bytes", "-1"], "max_body_bytes", "1024.."),
        (["--max-concurrency", "-1"], "max_concurrency", "0.."),
        (["--max-queue", "-5"], "max_queue", "0.."),
        (["--health-failures", "0"], "health_failures", "1..100"),
        (["--log-level", "foo"], "log_level", "one of 'debug'"),
        (["--upstream-client", "curl"], "upstream_client", "one of"),
        (["--connect-timeout", "0"], "connect_timeout", "> 0"),
        (["--port", "70000"], "port", "1..65535"),
        (["--replica-id", "5000"], "replica_id", "0..4095"),
        (["--rate-limit", "-2"], "rate_limit", "0.."),
        (["--max-items", "x"], "max_items", "valid integer"),
        (["--health-endpoint", "/admin"], "health_endpoint", "one of"),
    ],
    ids=["body-negative", "concurrency-negative", "queue-negative", "health-failures-zero",
         "log-level", "client-choice", "timeout-zero", "port-high", "replica-high",
         "rate-negative", "items-not-int", "health-endpoint"],
)
def test_bad_values_name_the_setting_and_what_it_allows(flags, setting, allowed):
    with pytest.raises(ConfigError) as info:
        load_config(BASE + flags, environ={})
    assert f"'{setting}'" in str(info.value)
    assert allowed in str(info.value)


def test_env_values_are_checked_like_flags():
    with pytest.raises(ConfigError, match="'max_queue'"):
        load_config(BASE, environ={"GATEWAY_MAX_QUEUE": "-1"})
    cfg = load_config(BASE, environ={"GATEWAY_SKIP_PROBE": "yes", "GATEWAY_MAX_QUEUE": "7"})
    assert cfg.skip_probe is True and cfg.max_queue == 7


def test_help_shows_ranges_and_choices(capsys):
    with pytest.raises(SystemExit):
        load_config(["--help"], environ={})
    out = capsys.readouterr().out
    assert "[1..65535]" in out and "one of debug, info" in out


def test_keys_from_files_and_env(tmp_path):
    inference = tmp_path / "keys"
    inference.write_text("# inference keys\nk-one-1234\n\nk-two-5678\n")
    admin = tmp_path / "admin"
    admin.write_text("a-admin-999\n")
    cfg = load_config(BASE + ["--api-key-file", str(inference), "--admin-api-key-file", str(admin)],
                      environ={"GATEWAY_API_KEYS": "k-env-0000"})
    assert cfg.api_keys == ("k-env-0000", "k-one-1234", "k-two-5678")
    assert cfg.admin_api_keys == ("a-admin-999",)


def test_a_key_cannot_be_both_inference_and_admin():
    with pytest.raises(ConfigError, match="both"):
        load_config(BASE + ["--api-keys", "same-key", "--admin-api-keys", "same-key"], environ={})


@pytest.mark.parametrize("flags, message", [
    (["--ssl-certfile", "/nonexistent.pem"], "go together"),
    (["--ssl-certfile", "/nonexistent.pem", "--ssl-keyfile", "/nonexistent.key"], "no file"),
    (["--ssl-ca-certs", "/etc/hostname"], "needs 'ssl_certfile'"),
], ids=["cert-without-key", "missing-files", "client-ca-without-cert"])
def test_tls_settings_are_checked(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(BASE + flags, environ={})


def test_repeated_list_flags_add_up():
    config = load_config([*BASE, "--api-key", "key-a", "--api-key", "key-b,key-c",
                          "--admin-api-keys", "adm-1", "--admin-api-key", "adm-2"], environ={})
    assert config.api_keys == ("key-a", "key-b", "key-c")
    assert config.admin_api_keys == ("adm-1", "adm-2")
