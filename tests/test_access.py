"""Who may do what (`proxy/request/access.py`), one class per rule of `decide`, then the pages'
rules, the exposure warning, and the `[access]` table of the config: plain values in. Last, the
warning as an application set up on 0.0.0.0 (never bound) logs it."""

from __future__ import annotations

import base64
import dataclasses
import hmac
import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy.app import create_app
from proxy.config import AccessConfig, ConfigError, config_to_dict, parse_config
from proxy.config.admin_endpoints import ADMIN_ENDPOINTS
from proxy.request import access as access_module
from proxy.request.access import (
    Allow,
    Refuse,
    decide,
    decide_load,
    decide_page,
    exposure,
    forwarded_headers,
    pages_mode,
)
from proxy.request.errors import Forbidden, Unauthorized
from proxy.state import STATE

UP = "upstream-key"
CLIENTS = {"clients": [{"name": "alice", "key": "alice-key"}, {"name": "bob", "key": "bob-key"}]}


def access(**table: Any) -> AccessConfig:
    return parse_config({"access": table}).access


def bearer(key: str) -> CIMultiDict[str]:
    return CIMultiDict({"Authorization": f"Bearer {key}"})


NONE: CIMultiDict[str] = CIMultiDict()


def chat(rules: AccessConfig, headers: CIMultiDict[str] = NONE, upstream_key: str = "") -> Allow | Refuse:
    return decide(rules, upstream_key, "POST", "/v1/chat/completions", headers)


class TestRule1PublicPaths:
    @pytest.mark.parametrize("path", ["/health", "/v1/health", "/health/"])
    def test_health_needs_no_key(self, path: str) -> None:
        assert decide(access(**CLIENTS), UP, "GET", path, NONE) == Allow(swap_credentials=True)

    @pytest.mark.parametrize("path", ["/v1/models", "/props", "/slots", "/metrics", "/models/sse",
                                      "/v1/stream", "/props/x.js", "/v1/x.json", "/%70rops",
                                      "/app/../props", "/completion"])
    def test_other_paths_need_a_key_as_llama_server_wants_one(self, path: str) -> None:
        assert isinstance(decide(access(), UP, "GET", path, NONE), Refuse)

    @pytest.mark.parametrize("path", ["/", "/index.html", "/sw.js", "/manifest.webmanifest",
                                      "/_app/version.json", "/_app/immutable/app.3f9a.js",
                                      "/secret.txt?x=1"])
    @pytest.mark.parametrize("rules", [access(), access(**CLIENTS)], ids=["upstream-key", "clients"])
    def test_the_web_ui_s_files_go_up_with_no_key_for_llama_server_to_decide(
            self, path: str, rules: AccessConfig) -> None:
        for headers in (NONE, bearer("guess")):
            allowed = decide(rules, UP, "GET", path, headers)
            assert allowed == Allow(strip_credentials=True)
            assert allowed.upstream_auth({"Authorization": f"Bearer {UP}"}) == {}
        assert decide(rules, UP, "HEAD", path, NONE) == Allow(strip_credentials=True)
        assert decide(rules, UP, "POST", path, NONE).status == 401  # type: ignore[union-attr]

    def test_a_ui_file_with_a_known_key_goes_with_the_servers_key(self) -> None:
        allowed = decide(access(**CLIENTS), UP, "GET", "/sw.js", bearer("alice-key"))
        assert allowed == Allow(client="alice", swap_credentials=True)
        assert allowed.upstream_auth({"Authorization": f"Bearer {UP}"}) == {
            "Authorization": f"Bearer {UP}"}

    def test_a_preflight_needs_no_key_even_on_an_admin_path(self) -> None:
        assert isinstance(decide(access(**CLIENTS), "", "OPTIONS", "/lora-adapters", NONE), Allow)

    def test_only_reading_a_public_path_is_public(self) -> None:
        assert decide(access(**CLIENTS), "", "POST", "/health", NONE).status == 401  # type: ignore[union-attr]


class TestRule2ClientKeys:
    def test_no_key_is_401_saying_what_to_send(self) -> None:
        refused = chat(access(**CLIENTS))
        assert isinstance(refused, Refuse) and refused.status == 401
        assert "carries no key" in refused.message and "[access] clients" in refused.message
        error = refused.error()
        assert isinstance(error, Unauthorized) and error.outcome == "unauthorized"
        assert error.headers() == {"WWW-Authenticate": 'Bearer realm="slotwise"'}

    def test_a_wrong_key_is_401(self) -> None:
        refused = chat(access(**CLIENTS), bearer("guess"))
        assert isinstance(refused, Refuse) and "not known" in refused.message

    def test_the_key_names_the_client(self) -> None:
        assert chat(access(**CLIENTS), bearer("alice-key")) == Allow("alice", swap_credentials=True)
        assert chat(access(**CLIENTS), CIMultiDict({"authorization": "bearer bob-key"})) == \
            Allow("bob", swap_credentials=True)

    def test_anthropic_style_x_api_key(self) -> None:
        assert chat(access(**CLIENTS), CIMultiDict({"x-api-key": "bob-key"})) == Allow("bob", True)

    def test_the_admin_key_is_a_key_too(self) -> None:
        assert chat(access(**CLIENTS, admin_key="adm"), bearer("adm")) == Allow("admin", True)

    def test_the_upstream_key_is_no_client_key(self) -> None:
        assert isinstance(chat(access(**CLIENTS), bearer(UP), upstream_key=UP), Refuse)

    def test_keys_are_compared_in_constant_time_against_every_key(
            self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls: list[tuple[bytes, bytes]] = []
        compare = hmac.compare_digest

        def counting(a: bytes, b: bytes) -> bool:
            calls.append((a, b))
            return compare(a, b)

        monkeypatch.setattr(access_module.hmac, "compare_digest", counting)
        headers = CIMultiDict({"Authorization": "Bearer alice-key", "x-api-key": "other"})
        assert chat(access(**CLIENTS, admin_key="adm"), headers) == Allow("alice", True)
        assert len(calls) == 2 * 3  # both candidates against all three keys, whatever matched

    def test_a_key_that_is_not_ascii_is_refused_not_crashed(self) -> None:
        assert isinstance(chat(access(**CLIENTS), bearer("\udcff\u00e9")), Refuse)


class TestRule3UpstreamKeyOnly:
    def test_no_key_is_401_naming_the_upstream_key(self) -> None:
        refused = chat(access(), upstream_key=UP)
        assert isinstance(refused, Refuse) and refused.status == 401
        assert "[upstream] api_key" in refused.message

    def test_the_upstream_key_passes_unnamed(self) -> None:
        assert chat(access(), bearer(UP), upstream_key=UP) == Allow(None, swap_credentials=True)

    def test_the_admin_key_passes_named(self) -> None:
        assert chat(access(admin_key="adm"), bearer("adm"), UP) == Allow("admin", True)


class TestRule4NoKeys:
    def test_no_key_is_needed_and_credentials_pass_as_sent(self) -> None:
        assert chat(access(), bearer("the-clients-own")) == Allow(None, swap_credentials=False)

    def test_the_admin_key_is_still_recognised_and_never_forwarded(self) -> None:
        assert chat(access(admin_key="adm"), bearer("adm")) == Allow("admin", swap_credentials=True)


class TestRule5AdminEndpoints:
    @pytest.mark.parametrize("endpoint", ADMIN_ENDPOINTS, ids=lambda e: e.name)
    def test_every_admin_endpoint_is_refused_by_default(self, endpoint: Any) -> None:
        path = endpoint.path.replace("/*", "/0")
        refused = decide(access(), "", endpoint.method, path, NONE)
        assert isinstance(refused, Refuse) and refused.status == 403
        assert f'"{endpoint.name}" to [access] allow' in refused.message
        assert isinstance(refused.error(), Forbidden) and refused.error().outcome == "forbidden"

    @pytest.mark.parametrize("method,path", [
        ("POST", "/slots/0?action=erase"), ("POST", "/slots%2F1?action=save"), ("HEAD", "/slots"),
        ("POST", "//lora-adapters/"), ("POST", "/v1/../lora-adapters"), ("post", "/lora%2Dadapters"),
        ("GET", "/slots?fail_on_no_slot=1"),
    ])
    def test_spellings_of_an_admin_path_are_refused(self, method: str, path: str) -> None:
        assert isinstance(decide(access(), "", method, path, NONE), Refuse)

    @pytest.mark.parametrize("method,path", [
        ("GET", "/lora-adapters"), ("GET", "/props"), ("GET", "/v1/models"), ("POST", "/tokenize"),
        ("POST", "/apply-template"), ("POST", "/v1/messages"), ("GET", "/slotsx"),
    ])
    def test_read_only_and_model_endpoints_pass(self, method: str, path: str) -> None:
        assert decide(access(), "", method, path, NONE) == Allow()

    def test_the_allow_list_reenables_one_endpoint_for_every_client(self) -> None:
        rules = access(allow=["POST /lora-adapters"])
        assert decide(rules, "", "POST", "/lora-adapters", NONE) == Allow()
        assert isinstance(decide(rules, "", "GET", "/slots", NONE), Refuse)

    def test_the_admin_key_reenables_every_one(self) -> None:
        assert decide(access(admin_key="adm"), "", "POST", "/slots/0", bearer("adm")) == \
            Allow("admin", swap_credentials=True)

    def test_a_missing_key_is_told_before_the_endpoint(self) -> None:
        refused = decide(access(**CLIENTS), "", "POST", "/lora-adapters", NONE)
        assert isinstance(refused, Refuse) and refused.status == 401

    def test_a_client_key_is_not_the_admin_key(self) -> None:
        refused = decide(access(**CLIENTS), "", "POST", "/lora-adapters", bearer("alice-key"))
        assert isinstance(refused, Refuse) and refused.status == 403


class TestRule6CredentialsSwapped:
    def test_the_clients_credentials_are_replaced_by_the_upstreams_key(self) -> None:
        sent = CIMultiDict({"authorization": "Bearer alice-key", "X-Api-Key": "alice-key",
                            "Content-Type": "application/json"})
        out = forwarded_headers(sent, {"Authorization": f"Bearer {UP}"})
        assert out.getall("Authorization") == [f"Bearer {UP}"] and "x-api-key" not in out
        assert out["Content-Type"] == "application/json"

    def test_without_an_upstream_key_they_are_only_removed(self) -> None:
        out = forwarded_headers(CIMultiDict({"Authorization": "Bearer alice-key"}), {})
        assert "Authorization" not in out


def config(host: str = "127.0.0.1", upstream_key: str = "", **table: Any) -> Any:
    return parse_config({"listen": {"host": host}, "upstream": {"api_key": upstream_key},
                         "access": table})


class TestLoad:
    """`decide_load`: /get_load wants a key where keys are in force (llama-server has no such
    endpoint; its /health is public, and so is slotwise's)."""

    @staticmethod
    def config(upstream_key: str = "", **table: Any) -> Any:
        return parse_config({"upstream": {"api_key": upstream_key} if upstream_key else {},
                             "access": table})

    def test_without_keys_anyone_may_read_it(self) -> None:
        assert decide_load(self.config(), "/get_load", NONE) == Allow()

    @pytest.mark.parametrize("key, client", [("alice-key", "alice"), ("page-token", "pages"),
                                             ("admin-key", "admin")])
    def test_with_client_keys_a_key_or_the_pages_token(self, key: str, client: str) -> None:
        config = self.config(UP, **CLIENTS, pages_token="page-token", admin_key="admin-key")
        assert decide_load(config, "/get_load", bearer(key)) == Allow(client=client)
        refused = decide_load(config, "/get_load", bearer(UP))  # the server's key is no client's
        assert isinstance(refused, Refuse) and refused.status == 401
        assert "a key of [access] clients" in refused.message

    def test_with_the_upstream_key_alone_that_key(self) -> None:
        assert decide_load(self.config(UP), "/get_load", bearer(UP)) == Allow()
        assert isinstance(decide_load(self.config(UP), "/get_load", NONE), Refuse)


class TestPages:
    @pytest.mark.parametrize("host,upstream_key,table,mode", [
        ("127.0.0.1", "", {}, "open"),
        ("::1", "", {}, "open"),
        ("localhost", "", {}, "open"),
        ("0.0.0.0", "", {}, "off"),
        ("192.168.1.5", "", {}, "off"),
        ("127.0.0.1", UP, {}, "off"),  # keys in force: not everyone on this machine is trusted
        ("127.0.0.1", "", CLIENTS, "off"),
        ("0.0.0.0", "", {"pages_token": "tok"}, "token"),
        ("127.0.0.1", "", {"admin_key": "adm"}, "token"),
        ("0.0.0.0", "", {"pages": "open"}, "open"),
        ("127.0.0.1", "", {"pages": "off"}, "off"),
    ])
    def test_auto_resolves(self, host: str, upstream_key: str, table: dict[str, Any], mode: str) -> None:
        assert pages_mode(config(host, upstream_key, **table)) == mode

    def test_off_is_403_saying_how_to_turn_it_on(self) -> None:
        refused = decide_page(config("0.0.0.0"), "/metrics", NONE)
        assert isinstance(refused, Refuse) and refused.status == 403
        assert "0.0.0.0, not a loopback address" in refused.message
        assert "access.pages_token" in refused.message and "Bearer TOKEN" in refused.message

    def test_token_needs_the_token_as_bearer_or_basic_password(self) -> None:
        conf = config("0.0.0.0", pages_token="tok", admin_key="adm", **CLIENTS)
        refused = decide_page(conf, "/metrics", NONE)
        assert isinstance(refused, Refuse) and refused.status == 401
        assert refused.error().headers()["WWW-Authenticate"].startswith("Basic ")
        assert decide_page(conf, "/metrics", bearer("tok")) == Allow("pages")
        basic = CIMultiDict({"Authorization": "Basic " + base64.b64encode(b"me:tok").decode()})
        assert decide_page(conf, "/slotwise/", basic) == Allow("pages")
        assert decide_page(conf, "/slotwise/status", bearer("adm")) == Allow("admin")
        assert isinstance(decide_page(conf, "/metrics", bearer("alice-key")), Refuse)
        assert isinstance(decide_page(conf, "/metrics", CIMultiDict({"Authorization": "Basic !!"})),
                          Refuse)


class TestExposure:
    def test_loopback_says_nothing(self) -> None:
        assert exposure(config()) is None

    def test_an_open_address_says_what_is_open_to_whom(self) -> None:
        line = exposure(config("0.0.0.0", allow=["GET /slots"]))
        assert line is not None and "\n" not in line
        assert "anyone who can reach it may use the model endpoints, GET /slots without a key" in line
        assert "pages off" in line and "[access] clients" in line

    def test_keys_and_closed_pages_say_nothing(self) -> None:
        assert exposure(config("0.0.0.0", **CLIENTS)) is None
        assert exposure(config("0.0.0.0", UP)) is None

    def test_open_pages_are_told_even_with_keys(self) -> None:
        line = exposure(config("0.0.0.0", pages="open", **CLIENTS))
        assert line is not None and "the pages /metrics and /slotwise/" in line


class TestConfig:
    def test_the_default_is_no_keys_no_allow_auto_pages(self) -> None:
        assert parse_config({}).access == AccessConfig()

    def test_keys_inline_and_from_files_are_read_and_never_shown(self, tmp_path: Path) -> None:
        key_file = tmp_path / "bot.key"
        key_file.write_text("bot-key\n")
        conf = parse_config({"access": {
            "clients": [{"name": "alice", "key": "alice-key"},
                        {"name": "bot", "key_file": str(key_file)}],
            "admin_key": "adm-key", "pages_token": "tok-key",
            "allow": ["get   /slots", "GET /slots"]}})
        assert [(c.name, c.key) for c in conf.access.clients] == [("alice", "alice-key"),
                                                                  ("bot", "bot-key")]
        assert conf.access.allow == ("GET /slots",)
        shown = config_to_dict(conf)["access"]
        assert [c["key"] for c in shown["clients"]] == ["***", "***"]
        assert shown["admin_key"] == shown["pages_token"] == "***"
        assert not {"alice-key", "bot-key", "adm-key", "tok-key"} & set(repr(conf).split("'"))

    @pytest.mark.parametrize("table,message", [
        ({"clients": {"name": "a"}}, r"access\.clients: expected an array of tables"),
        ({"clients": ["alice"]}, r"access\.clients\[0\]: expected a table"),
        ({"clients": [{"name": "alice"}]}, r"access\.clients\[0\]: give 'key' .* or 'key_file'"),
        ({"clients": [{"name": "a b", "key": "k"}]}, r"access\.clients\[0\]\.name: 'a b' is not a name"),
        ({"clients": [{"name": "admin", "key": "k"}]}, r"access\.clients\[0\]\.name: 'admin' is the name"),
        ({"clients": [{"name": "a", "key": "k", "key_file": "/x"}]},
         r"access\.clients\[0\]\.key: give at most one of 'key' and 'key_file'"),
        ({"clients": [{"name": "a", "key": "k", "role": "x"}]},
         r"access\.clients\[0\]\.role: unknown key \(valid: name, key, key_file\)"),
        ({"clients": [{"name": "a", "key": "k1"}, {"name": "a", "key": "k2"}]},
         r"access\.clients\[1\]\.name: 'a' is already the name of access\.clients\[0\]"),
        ({"clients": [{"name": "a", "key": "k1"}, {"name": "b", "key": "k1"}]},
         r"access\.clients\[1\]\.key: the same key as access\.clients\[0\]"),
        ({"clients": [{"name": "a", "key": "two words"}]}, r"access\.clients\[0\]\.key: the key holds"),
        ({"admin_key": "k", "pages_token": "k"}, r"access\.pages_token: the same key as access\.admin_key"),
        ({"allow": ["POST /completion"]},
         r"access\.allow\[0\]: 'POST /completion' is not an admin endpoint \(valid: POST /lora-adapters, "),
        ({"allow": "GET /slots"}, r"access\.allow: expected an array of strings"),
        ({"pages": "closed"}, r"access\.pages: unknown pages 'closed' \(valid: auto, open, token, off\)"),
        ({"pages": "token"}, r"access\.pages: 'token' needs access\.pages_token or access\.admin_key"),
        ({"admin_key_file": "/nonexistent/adm"}, r"access\.admin_key_file: cannot read '/nonexistent/adm'"),
        ({"keys": []}, r"access\.keys: unknown key \(valid: clients, admin_key"),
    ])
    def test_bad_tables_are_refused_naming_the_key(self, table: dict[str, Any], message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            parse_config({"access": table})

    def test_no_client_holds_the_servers_key(self) -> None:
        with pytest.raises(ConfigError, match=r"access\.clients\[0\]\.key: the same key as "
                                              r"upstream\.api_key .*never hold the server's key"):
            parse_config({"upstream": {"api_key": UP}, "access": {"clients": [{"name": "a", "key": UP}]}})

    def test_a_key_is_never_in_a_message(self) -> None:
        with pytest.raises(ConfigError) as caught:
            parse_config({"access": {"clients": [{"name": "a", "key": "sekrit1"},
                                                 {"name": "b", "key": "sekrit1"}]}})
        assert "sekrit1" not in str(caught.value)


@pytest.mark.parametrize("doc", ["config/slotwise.toml", "docs/security.md"])
def test_every_admin_endpoint_is_documented(doc: str) -> None:
    text = (Path(__file__).parent.parent / doc).read_text()
    missing = [e.name for e in ADMIN_ENDPOINTS
               if f"\"{e.name}\"" not in text and f"`{e.name}`" not in text]
    assert missing == []


async def test_start_up_and_each_reload_warn_in_one_line_what_is_open(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    conf = parse_config({"listen": {"host": "0.0.0.0"}, "log": {"timing": str(tmp_path / "t.jsonl")},
                         "upstream": {"url": "http://127.0.0.1:9"}})
    runner = web.AppRunner(create_app(conf))  # set up, never bound
    with caplog.at_level(logging.WARNING, logger="slotwise"):
        await runner.setup()
        try:
            warned = [r.getMessage() for r in caplog.records if "not loopback" in r.getMessage()]
            assert len(warned) == 1 and "may use the model endpoints without a key" in warned[0]
            state = runner.app[STATE]
            await state.apply_config(dataclasses.replace(conf, access=parse_config(
                {"access": CLIENTS}).access))
            assert sum("not loopback" in r.getMessage() for r in caplog.records) == 1  # keys: quiet
        finally:
            await runner.cleanup()
