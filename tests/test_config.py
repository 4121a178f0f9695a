"""The config: strict, with errors that name the dotted key, the value and the valid set."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import main
from proxy.config import ConfigError, config_to_dict, load_config, parse_config
from proxy.config.tables import MAX_PURPOSE
from proxy.record.clientstrings import MAX_CHARS

EXAMPLE = Path(__file__).parent.parent / "config" / "slotwise.toml"


def test_defaults_are_usable() -> None:
    config = parse_config({})
    assert config.listen.host == "127.0.0.1"
    assert config.lora.mode == "passthrough" and config.prefill.mode == "off"


def test_a_background_purpose_is_as_long_as_a_record_keeps_whole() -> None:
    assert MAX_PURPOSE == MAX_CHARS - 1
    assert parse_config({"prefill": {"background_purposes": ["t" * MAX_PURPOSE]}})
    with pytest.raises(ConfigError, match=r"background_purposes\[0\]"):
        parse_config({"prefill": {"background_purposes": ["t" * MAX_CHARS]}})


@pytest.mark.parametrize(("data", "message"), [
    ({"prefill": {"mode": "chunks"}},
     "prefill.mode: unknown mode 'chunks' (valid: off, defer, chunk)"),
    ({"listen": {"prot": 1}}, "listen.prot: unknown key (valid: host, port, max_body_mb"),
    ({"bogus": {}}, "bogus: unknown key"),
    ({"listen": {"port": "80"}}, "listen.port: expected a whole number, got '80'"),
    ({"listen": {"port": 70000}}, "listen.port: 70000 is out of range"),
    ({"upstream": {"url": "localhost:8080"}}, "upstream.url: 'localhost:8080' is not an http(s) URL"),
    ({"lora": {"mode": "fixed"}}, "lora.adapters: mode 'fixed' needs at least one adapter"),
    ({"lora": {"mode": "fixed", "adapters": [{"name": "a.gguf", "id": 1}]}},
     "lora.adapters[0]: give exactly one of 'name'"),
    ({"lora": {"adapters": [{"name": "a.gguf", "scale": "high"}]}},
     "lora.adapters[0].scale: expected a number, got 'high'"),
    ({"prefill": {"prefill_share": 1.5}}, "prefill.prefill_share: 1.5 is out of range"),
    ({"prefill": {"background_purposes": "translation"}},
     "prefill.background_purposes: expected an array of strings like [\"translation\"], got "
     "'translation'"),
    ({"prefill": {"background_purposes": ["translation", ""]}},
     "prefill.background_purposes[1]: '' is not a purpose (valid: the X-Slotwise-Purpose value, "
     "printable text of 1-127 characters"),
])
def test_bad_values_are_refused_with_the_dotted_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert message in str(info.value)


@pytest.mark.parametrize(("table", "key", "valid"), [
    ("lora", "mode", "passthrough, fixed, none"),
    ("prefill", "mode", "off, defer, chunk"),
    ("log", "level", "debug, info, warning, error"),
    ("access", "pages", "auto, open, token, off"),
    ("access", "cache_scope", "client, shared"),
    ("cluster", "load_format", "vllm, sglang"),
])
def test_every_word_key_names_its_valid_words(table: str, key: str, valid: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({table: {key: "bogus"}})
    assert str(info.value) == f"{table}.{key}: unknown {key} 'bogus' (valid: {valid})"
    with pytest.raises(ConfigError, match=f"{table}.{key}: expected a string, got 3"):
        parse_config({table: {key: 3}})


def test_the_shipped_example_is_valid() -> None:
    config = load_config(EXAMPLE)
    assert config.upstream.url.startswith("http://127.0.0.1")


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[listen\nport = 1\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_config(path)


def test_check_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(EXAMPLE)]) == 0
    assert "valid" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('[prefill]\nmode = "chunks"\n')
    assert main(["check-config", str(bad)]) == 2
    assert "prefill.mode: unknown mode 'chunks'" in capsys.readouterr().err


def test_upstream_api_key_is_optional_and_never_shown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_config({}).upstream.api_key == ""
    assert parse_config({}).upstream.auth_headers() == {}
    config = parse_config({"upstream": {"api_key": "s3cret-key"}})
    assert config.upstream.auth_headers() == {"Authorization": "Bearer s3cret-key"}
    assert config_to_dict(config)["upstream"]["api_key"] == "***"
    assert config_to_dict(parse_config({}))["upstream"]["api_key"] == ""
    assert "s3cret-key" not in repr(config)
    path = tmp_path / "key.toml"
    path.write_text('[upstream]\napi_key = "s3cret-key"\n')
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "s3cret-key" not in out and "'***'" in out


def test_upstream_api_key_file_is_read_and_masked(tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("from-a-file\n")
    config = parse_config({"upstream": {"api_key_file": str(key_file)}})
    assert config.upstream.api_key == "from-a-file"
    assert config.upstream.api_key_file == str(key_file)
    shown = config_to_dict(config)["upstream"]
    assert shown["api_key"] == "***" and shown["api_key_file"] == str(key_file)


@pytest.mark.parametrize(("upstream", "message"), [
    ({"api_key": "a", "api_key_file": "/etc/hostname"},
     "upstream.api_key: give at most one of 'api_key' and 'api_key_file'"),
    ({"api_key_file": "/nonexistent/api-key"},
     "upstream.api_key_file: cannot read '/nonexistent/api-key': No such file or directory"),
    ({"api_key": 12345}, "upstream.api_key: expected a string, got a int"),
    ({"api_key": "two words"}, "upstream.api_key: the key holds whitespace"),
    ({"api_key_file": 3}, "upstream.api_key_file: expected a string, got 3"),
])
def test_bad_api_keys_are_refused(upstream: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"upstream": upstream})
    assert message in str(info.value)
    assert "12345" not in str(info.value)


def test_an_unreadable_or_empty_key_file_names_the_key(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"upstream\.api_key_file: .* is empty"):
        parse_config({"upstream": {"api_key_file": str(empty)}})
    with pytest.raises(ConfigError, match=r"upstream\.api_key_file: cannot read"):
        parse_config({"upstream": {"api_key_file": str(tmp_path)}})  # a directory


@pytest.mark.parametrize(("data", "message"), [
    ({"listen": {"header_timeout_s": 0}},
     "listen.header_timeout_s: 0 is out of range (valid: between 0.1 and 3600"),
    ({"listen": {"body_timeout_s": "slow"}}, "listen.body_timeout_s: expected a number, got 'slow'"),
    ({"listen": {"keepalive_timeout_s": -1}}, "listen.keepalive_timeout_s: -1 is out of range"),
    ({"listen": {"max_connections": 0}}, "listen.max_connections: 0 is out of range (valid: between 1"),
    ({"listen": {"max_connections": 1.5}}, "listen.max_connections: expected a whole number, got 1.5"),
    ({"upstream": {"max_event_mb": 0}}, "upstream.max_event_mb: 0 is out of range (valid: between 0.01"),
])
def test_the_resource_limits_are_checked(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert message in str(info.value)


def test_the_resource_limits_default_to_a_small_team_and_the_example_shows_them() -> None:
    listen, upstream = parse_config({}).listen, parse_config({}).upstream
    assert (listen.header_timeout_s, listen.body_timeout_s, listen.keepalive_timeout_s) == (10, 60, 60)
    assert listen.max_connections == 1024 and upstream.max_event_mb == 16
    text = EXAMPLE.read_text()
    for key in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "max_connections",
                "max_event_mb"):
        assert f"\n{key} = " in text
