"""The configuration layer (frontend/config.py): every KILN_* variable and option checked
once; a bad value or unknown name is one warning naming it and the default, never a
raise; only settings that change compiled code reach the key."""

from __future__ import annotations

import warnings

import pytest

from kiln.frontend import config as config_module
from kiln.frontend.config import SETTINGS, KilnConfig, KilnConfigWarning, option_problems


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "_warned", set())


def resolve(options: dict[str, object] | None = None, **env: str
            ) -> tuple[KilnConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = KilnConfig.resolve(options, env=env)
    assert all(issubclass(w.category, KilnConfigWarning) for w in caught)
    return config, [str(w.message) for w in caught]


def test_defaults_with_a_clean_environment() -> None:
    config, messages = resolve()
    assert messages == [] and config.problems == ()
    assert (config.farm, config.farm_timeout, config.cpu_backend, config.autotune) == (
        "local", 300.0, "cpp", True)
    assert config.compiler_options() == {"autotune": True, "cpu_backend": "cpp",
                                         "deterministic": False}


@pytest.mark.parametrize(("variable", "value", "expected", "default_shown"), [
    ("KILN_FARM_TIMEOUT", "abc", "expected a number of seconds", "default 300"),
    ("KILN_FARM_TIMEOUT", "-5", "positive", "default 300"),
    ("KILN_AUTOTUNE", "banana", "expected 1 or 0", "default 1"),
    ("KILN_STORE_TIMEOUT", "0", "positive", "default 10"),
    ("KILN_LOCAL_CACHE_SIZE", "10Q", "expected a size", "default 10G"),
    ("KILN_CPU_BACKEND", "fortran", "expected one of cpp, triton-interpret", "default 'cpp'"),
    ("KILN_FARM", "inproces", "did you mean inprocess?", "default 'local'"),
    ("KILN_FARM", "host:99999", "port from 1 to 65535", "default 'local'"),
    ("KILN_STORE_OPTIONS", "{not json", "expected a JSON object", "default (unset)"),
    ("KILN_LOGS", "output_cod", "did you mean output_code?", "default ''"),
])
def test_a_bad_variable_is_one_warning_naming_it_and_the_default(
        variable: str, value: str, expected: str, default_shown: str) -> None:
    config, messages = resolve(**{variable: value})
    (message,) = messages
    assert message.startswith(f"kiln: {variable}={value!r}: ")
    assert expected in message and default_shown in message
    setting = SETTINGS[variable.removeprefix("KILN_").lower()]
    assert getattr(config, setting.name) == setting.default


def test_each_problem_is_warned_once_per_process() -> None:
    _, first = resolve(KILN_AUTOTUNE="banana")
    _, second = resolve(KILN_AUTOTUNE="banana")
    assert len(first) == 1 and second == []


def test_good_values_parse_to_their_types() -> None:
    config, messages = resolve(KILN_FARM_TIMEOUT="2.5", KILN_AUTOTUNE="off",
                               KILN_STORE_READ_ONLY="yes", KILN_LOCAL_CACHE_SIZE="512M",
                               KILN_FARM="ray://head:10001", KILN_STATS_FILE="off",
                               KILN_STORE_OPTIONS='{"anon": true}')
    assert messages == []
    assert (config.farm_timeout, config.autotune, config.store_read_only) == (2.5, False, True)
    assert config.local_cache_size == 512 * 2**20 and config.farm == "ray://head:10001"
    store = config.store_kwargs()
    assert store["stats_file"] is False and store["storage_options"] == {"anon": True}
    assert store["read_only"] is True and store["local_cache_max_bytes"] == 512 * 2**20


def test_options_win_over_variables_and_ray_address_is_the_farm_fallback() -> None:
    config, _ = resolve({"CPU_BACKEND": "triton-interpret", "farm_timeout": 7},
                        KILN_CPU_BACKEND="cpp", RAY_ADDRESS="10.0.0.1:6379")
    assert (config.cpu_backend, config.farm_timeout) == ("triton-interpret", 7.0)
    assert config.farm == "10.0.0.1:6379"
    assert resolve(KILN_FARM="inprocess", RAY_ADDRESS="10.0.0.1:6379")[0].farm == "inprocess"


def test_unknown_names_are_warned_with_the_nearest_and_never_reach_the_key() -> None:
    config, messages = resolve({"cpu_bakend": "triton-interpret"}, KILN_STOER="/x")
    assert "unknown option 'cpu_bakend' (did you mean cpu_backend?); it is ignored" in \
        messages[0]
    assert "KILN_STOER is not a Kiln variable (did you mean KILN_STORE?)" in messages[1]
    assert config.compiler_options() == {"autotune": True, "cpu_backend": "cpp",
                                         "deterministic": False}


def test_settings_that_do_not_change_code_stay_out_of_the_key() -> None:
    plain, _ = resolve()
    busy, messages = resolve({"farm_timeout": 5, "logs": "output_code", "debug": "1",
                              "store_timeout": 3, "debug_dir": "/tmp/d"},
                             KILN_STATS_FILE="off", KILN_FARM="inprocess")
    assert messages == []
    assert busy.compiler_options() == plain.compiler_options()
    assert {s.name for s in SETTINGS.values() if s.in_key} == {"cpu_backend", "autotune",
                                                               "deterministic"}


def test_option_problems_are_what_the_cli_refuses() -> None:
    assert option_problems({"cpu_backend": "cpp", "autotune": 0}) == []
    assert option_problems({"bogus": 1}) == ["unknown option 'bogus'"]
    assert option_problems({"cpu_backend": "fortran"}) == [
        "option cpu_backend='fortran': expected one of cpp, triton-interpret"]
    assert option_problems({"cxx": "clang++"}) == [
        "option cxx is set by the environment only (KILN_CXX)"]



def test_a_join_failure_names_its_cause_and_fix() -> None:
    from kiln.workers.ray_farm import explain_join_failure

    ray_said = ("gcs_client.cc:210: Failed to get cluster ID from GCS server: Unauthenticated: "
                "RPC error: InvalidAuthToken: Authentication token is missing or incorrect")
    auth = explain_join_failure("10.0.0.1:6379", ConnectionError("Failed to connect"), ray_said)
    assert "refused this client" in auth and "set RAY_AUTH_TOKEN" in auth
    notice = ("WARNING authentication_token_setup.py:85 -- Token authentication is enabled "
              "for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
    other = explain_join_failure("10.0.0.1:6379", ConnectionError("Failed to connect"), notice)
    assert other == ("cannot join the Ray cluster at 10.0.0.1:6379: ConnectionError: Failed "
                     "to connect")
