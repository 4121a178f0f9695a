"""The LoRA profile, pure: the array built from config + the server's adapter list, the errors for a
config that does not fit the server, and the profile's readiness and caching."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.config import ConfigError, LoraConfig, parse_config
from proxy.ops.lora import (
    LoraConfigError,
    LoraListError,
    LoraProfile,
    ServerAdapter,
    build_lora_array,
    global_differs,
    parse_server_adapters,
)
from proxy.request.errors import LoraNotReady

URL = "http://127.0.0.1:8080"
TWO = (ServerAdapter(0, "/models/style.gguf"), ServerAdapter(1, "/models/lang-de.gguf"))


def lora(mode: str, *adapters: dict[str, Any]) -> LoraConfig:
    return parse_config({"lora": {"mode": mode, "adapters": list(adapters)}}).lora


def test_server_list_is_parsed_in_id_order_with_extra_fields_ignored() -> None:
    data = [{"id": 1, "path": "b.gguf", "scale": 1.0, "task_name": "", "prompt_prefix": ""},
            {"id": 0, "path": "/x/a.gguf", "scale": 0.0}]
    assert parse_server_adapters(data) == (ServerAdapter(0, "/x/a.gguf"), ServerAdapter(1, "b.gguf"))
    assert parse_server_adapters([]) == ()


@pytest.mark.parametrize("data", [{"id": 0}, [{"path": "a.gguf"}], [{"id": "0", "path": "a"}],
                                  [{"id": True, "path": "a"}], ["a.gguf"]])
def test_a_server_answer_that_is_not_an_adapter_list_is_an_error(data: Any) -> None:
    with pytest.raises(LoraListError):
        parse_server_adapters(data)


def test_file_name_is_the_last_path_part_on_any_platform() -> None:
    assert ServerAdapter(0, "/m/style.gguf").file_name == "style.gguf"
    assert ServerAdapter(0, "C:\\m\\style.gguf").file_name == "style.gguf"
    assert ServerAdapter(0, "style.gguf").file_name == "style.gguf"


def test_passthrough_forwards_what_the_client_sent() -> None:
    assert build_lora_array(lora("passthrough"), TWO) is None
    assert build_lora_array(lora("passthrough"), ()) is None


def test_fixed_lists_every_loaded_adapter_in_id_order_unnamed_ones_at_zero() -> None:
    array = build_lora_array(lora("fixed", {"name": "lang-de.gguf", "scale": 0.8}), TWO)
    assert array == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.8}]


def test_fixed_names_adapters_by_id_by_file_name_or_by_full_path() -> None:
    by_id = build_lora_array(lora("fixed", {"id": 0, "scale": 0.5}), TWO)
    by_path = build_lora_array(lora("fixed", {"name": "/models/style.gguf", "scale": 0.5}), TWO)
    assert by_id == by_path == [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 0.0}]


def test_none_sets_every_loaded_adapter_to_zero() -> None:
    assert build_lora_array(lora("none"), TWO) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]


def test_none_with_no_adapter_loaded_forwards_nothing_not_an_empty_array() -> None:
    # `[]` would mean "the server's global list" to llama-server.
    assert build_lora_array(lora("none"), ()) is None


def test_fixed_with_no_adapter_loaded_is_refused_with_the_reason() -> None:
    with pytest.raises(LoraConfigError, match=r"^lora.mode: 'fixed' needs LoRA adapters loaded in "
                                              r"llama-server, but the server at X has none"):
        build_lora_array(lora("fixed", {"id": 0}), (), "the server at X")


def test_an_unknown_name_is_an_error_that_lists_what_the_server_has() -> None:
    with pytest.raises(LoraConfigError) as caught:
        build_lora_array(lora("fixed", {"id": 0}, {"name": "styel.gguf"}), TWO)
    assert str(caught.value) == (
        "lora.adapters[1].name: 'styel.gguf' is not loaded in the llama-server "
        "(valid: it has id 0 'style.gguf', id 1 'lang-de.gguf')")


def test_an_unknown_id_is_an_error_that_lists_what_the_server_has() -> None:
    with pytest.raises(LoraConfigError, match=r"^lora.adapters\[0\].id: 7 is not loaded .*"
                                              r"id 0 'style.gguf', id 1 'lang-de.gguf'"):
        build_lora_array(lora("fixed", {"id": 7}), TWO)


def test_the_same_adapter_named_twice_is_an_error() -> None:
    with pytest.raises(LoraConfigError, match=r"^lora.adapters\[1\]: names id 0 'style.gguf' "
                                              r"again, as lora.adapters\[0\] does"):
        build_lora_array(lora("fixed", {"name": "style.gguf"}, {"id": 0}), TWO)


def test_a_file_name_loaded_twice_must_be_named_by_path_or_id() -> None:
    twins = (ServerAdapter(0, "/a/x.gguf"), ServerAdapter(1, "/b/x.gguf"))
    with pytest.raises(LoraConfigError, match="matches several loaded adapters"):
        build_lora_array(lora("fixed", {"name": "x.gguf"}), twins)
    assert build_lora_array(lora("fixed", {"name": "/b/x.gguf"}), twins) == [
        {"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}]


def test_the_config_error_is_a_config_error_so_a_reload_is_refused() -> None:
    assert issubclass(LoraConfigError, ConfigError)


def test_profile_in_passthrough_needs_no_server() -> None:
    assert LoraProfile().forced(lora("passthrough"), URL) is None


def test_profile_refuses_model_requests_until_the_list_is_read() -> None:
    profile = LoraProfile()
    profile.unreadable("GET x/lora-adapters: connection refused")
    with pytest.raises(LoraNotReady, match=r"not ready.*connection refused") as caught:
        profile.forced(lora("none"), URL)
    assert caught.value.status == 503
    profile.update(URL, TWO)
    assert profile.forced(lora("none"), URL) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]


def test_profile_keeps_the_list_while_the_upstream_is_unreadable() -> None:
    profile = LoraProfile()
    profile.update(URL, TWO)
    profile.unreadable("down")
    assert profile.forced(lora("fixed", {"id": 1}), URL) == [{"id": 0, "scale": 0.0},
                                                             {"id": 1, "scale": 1.0}]


def test_profile_list_of_another_upstream_does_not_count() -> None:
    profile = LoraProfile()
    profile.update(URL, TWO)
    with pytest.raises(LoraNotReady):
        profile.forced(lora("none"), "http://other:1")


def test_profile_refuses_when_the_server_no_longer_has_the_adapter() -> None:
    profile = LoraProfile()
    profile.update(URL, TWO)
    config = lora("fixed", {"name": "lang-de.gguf"})
    assert profile.forced(config, URL) is not None
    assert profile.update(URL, TWO[:1]) is True
    with pytest.raises(LoraNotReady, match=r"lora.adapters\[0\].name: 'lang-de.gguf' is not loaded"):
        profile.forced(config, URL)


def test_profile_reports_whether_a_read_changed_the_list() -> None:
    profile = LoraProfile()
    assert profile.update(URL, TWO) is True
    assert profile.update(URL, TWO) is False
    assert profile.update(URL, tuple(reversed(TWO))) is True


def test_profile_gives_every_request_its_own_copy_of_one_identical_array() -> None:
    profile = LoraProfile()
    profile.update(URL, TWO)
    config = lora("fixed", {"id": 0, "scale": 0.25})
    first, second = profile.forced(config, URL), profile.forced(config, URL)
    assert first == second and first is not second
    assert first is not None
    first[0]["scale"] = 9.0
    assert profile.forced(config, URL) == second


def test_profile_follows_the_config_it_is_given() -> None:
    profile = LoraProfile()
    profile.update(URL, TWO)
    assert profile.forced(lora("fixed", {"id": 0}), URL) == [{"id": 0, "scale": 1.0},
                                                             {"id": 1, "scale": 0.0}]
    assert profile.forced(lora("fixed", {"id": 1}), URL) == [{"id": 0, "scale": 0.0},
                                                             {"id": 1, "scale": 1.0}]


def test_the_server_global_scale_is_read_but_not_compared() -> None:
    (adapter,) = parse_server_adapters([{"id": 0, "path": "a.gguf", "scale": 0.25}])
    assert adapter.scale == 0.25
    assert adapter == ServerAdapter(0, "a.gguf", scale=1.0)


def test_global_scales_differ_unless_every_adapter_has_the_profile_scale() -> None:
    array = [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.3}]
    at = (ServerAdapter(0, "a", 0.0), ServerAdapter(1, "b", 0.30000001192092896))
    assert not global_differs(array, at)
    assert global_differs(array, (ServerAdapter(0, "a", 1.0), ServerAdapter(1, "b", 0.3)))
    assert global_differs([{"id": 0, "scale": 0.0}], (ServerAdapter(0, "a", 0.0),
                                                      ServerAdapter(1, "b", 1.0)))
