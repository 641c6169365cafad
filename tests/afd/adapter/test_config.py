# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-afd project
"""AFDConfig: CLI flags, afd-plugin's --additional-config form, validation, hashing."""

import sys

import pytest

import preload

from vllm.afd.adapter.config import AFDConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser


MODEL = None


@pytest.fixture(autouse=True, scope="module")
def _model(models_dir):
    # EngineArgs resolves its model at construction: give it a local one.
    global MODEL
    MODEL = str(models_dir / "tiny-qwen3-moe")


def parse(*argv: str) -> EngineArgs:
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", MODEL, *argv]))


def afd_of(args: EngineArgs) -> AFDConfig | None:
    return AFDConfig.from_cli(args.afd_config, args.afd_role, args.additional_config)


def test_afd_off_by_default():
    assert afd_of(parse()) is None


def test_cli_role_and_json():
    cfg = afd_of(parse("--afd-role", "ffn", "--afd-config",
                       '{"host": "127.0.0.2", "port": 7800, "connector": "tcp", "timeout_s": 5}'))
    assert (cfg.role, cfg.host, cfg.port, cfg.connector, cfg.timeout_s) == (
        "ffn", "127.0.0.2", 7800, "tcp", 5.0)
    assert cfg.is_ffn and not cfg.is_attention


def test_role_flag_overrides_json():
    cfg = afd_of(parse("--afd-config", '{"role": "ffn"}', "--afd-role", "attention"))
    assert cfg.role == "attention"


def test_afd_plugin_additional_config_is_mapped():
    cfg = afd_of(parse("--additional-config", '{"afd": {"afd_role": "ffn", "afd_port": 1239, '
                       '"connector": "P2pNcclAFDConnector", "num_attention_ranks": 2, '
                       '"compute_gate_on_attention": "true", "connector_extra_config": {}}}'))
    assert (cfg.role, cfg.port, cfg.connector, cfg.num_attention_ranks, cfg.gate_on) == (
        "ffn", 1239, "nccl", 2, "attention")


@pytest.mark.parametrize("argv, message", [
    (["--afd-config", '{"role": "decoder"}'], "role\n  Input should be 'attention' or 'ffn'"),
    (["--afd-config", '{"connector": "rdma"}'],
     "AFDConfig.connector: unknown connector 'rdma'; valid names: ipc, loopback, nccl, shm, tcp"),
    (["--afd-config", '{"port": 70000}'], "AFDConfig.port: 70000 is not in 1-65535"),
    (["--afd-config", '{"num_ubatches": 5}'], "AFDConfig.num_ubatches: 5 is not in 1-4"),
    (["--afd-config", '{"ubatch_policy": "always"}'],
     "ubatch_policy\n  Input should be 'auto' or 'fixed'"),
    (["--afd-config", '{"num_ffn_ranks": 0}'], "AFDConfig.num_ffn_ranks: must be >= 1"),
    (["--afd-config", '{"timeout_s": 0}'], "AFDConfig.timeout_s: must be > 0"),
    (["--afd-config", '{"prot": 1}'], "unknown key(s) ['prot']; valid keys:"),
    (["--afd-config", '{"num_ffn_ranks": 2, "ffn_hosts": ["10.0.0.2"]}'],
     "AFDConfig.ffn_hosts: 1 addresses for 2 FFN ranks (num_ffn_ranks)"),
    (["--afd-config", '{"ffn_hosts": [""]}'], "AFDConfig.ffn_hosts: an address must not be empty"),
    (["--afd-config", '{"transfer_dtype": "int8"}'],
     "AFDConfig.transfer_dtype: 'int8' is not one of 'auto', 'fp8'"),
    (["--afd-config", '{"transfer_dtype": {"to_ffn": "bf16"}}'],
     "AFDConfig.transfer_dtype['to_ffn']: 'bf16' is not one of 'auto', 'fp8'"),
    (["--afd-config", '{"transfer_dtype": {"up": "fp8"}}'],
     "AFDConfig.transfer_dtype: unknown direction(s) ['up']; valid: 'to_ffn', 'to_attention'"),
    (["--additional-config", '{"afd": {"role": "ffn", "afd_role": "ffn"}}'], "given twice"),
    (["--additional-config", '{"afd": {"async": true}}'], "unknown key 'async'"),
])
def test_invalid_values_name_the_field(argv, message):
    with pytest.raises(ValueError, match=None) as e:
        afd_of(parse(*argv))
    assert message in str(e.value)


def test_transfer_dtype_per_direction():
    """One value for both directions, or per direction (a direction not named
    is 'auto'); the transfer dtype changes no graph."""
    assert (AFDConfig().transfer_to_ffn, AFDConfig().transfer_to_attention) == ("auto", "auto")
    both = AFDConfig(transfer_dtype="fp8")
    assert (both.transfer_to_ffn, both.transfer_to_attention) == ("fp8", "fp8")
    cfg = afd_of(parse("--afd-config", '{"transfer_dtype": {"to_ffn": "fp8"}}'))
    assert cfg.transfer_dtype == {"to_ffn": "fp8", "to_attention": "auto"}
    link = cfg.link_config()
    assert (link.send_transfer, link.receive_transfer) == ("fp8", "auto")
    ffn = link.replace(role="ffn")
    assert (ffn.send_transfer, ffn.receive_transfer) == ("auto", "fp8")
    assert both.compute_hash() == AFDConfig().compute_hash()


def test_bad_cli_values_fail_at_parse_time():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--afd-role", "bogus"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--afd-config", "{not json"])


def test_hash_covers_only_graph_factors():
    base = AFDConfig()
    assert base.compute_hash() == AFDConfig(port=9000, host="10.0.0.1", connector="tcp",
                                            timeout_s=3).compute_hash()
    assert base.compute_hash() != AFDConfig(role="ffn").compute_hash()
    assert base.compute_hash() != AFDConfig(num_ubatches=2).compute_hash()
    assert base.compute_hash() != AFDConfig(gate_on="attention").compute_hash()


def test_serve_help_shows_the_afd_group():
    out = preload.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
                       "--help=AFDConfig"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--afd-role {attention,ffn}" in out.stdout
    assert "Attention-FFN Disaggregation" in out.stdout


def test_afd_reaches_vllm_config_and_takes_the_runner_vllm_picks():
    plain = parse().create_engine_config()
    cfg = parse("--afd-role", "attention").create_engine_config()
    assert plain.afd_config is None
    assert cfg.afd_config is not None and cfg.afd_config.is_attention
    # AFD runs on Model Runner V1 and V2: it adds nothing to V2's unsupported
    # features, so CUDA picks V2 with AFD as without it.
    assert cfg._get_v2_model_runner_unsupported_features() == (
        plain._get_v2_model_runner_unsupported_features())
    assert cfg.use_v2_model_runner == plain.use_v2_model_runner
    # The role changes the compiled graph; the port does not.
    ffn = parse("--afd-role", "ffn").create_engine_config()
    other_port = parse("--afd-role", "attention", "--afd-config", '{"port": 9999}')
    assert cfg.compute_hash() != plain.compute_hash()
    assert cfg.compute_hash() != ffn.compute_hash()
    assert cfg.compute_hash() == other_port.create_engine_config().compute_hash()
    # The factors vLLM 0.34's VllmConfig.compile_factors takes as they are.
    assert cfg.afd_config.compile_factors() == {"role": "attention", "num_ubatches": 1,
                                                "gate_on": "ffn"}


def test_llm_kwargs_reach_engine_args():
    args = EngineArgs(model=MODEL, afd_role="ffn", afd_config={"port": 7801})
    cfg = args.create_engine_config()
    assert (cfg.afd_config.role, cfg.afd_config.port) == ("ffn", 7801)


def test_model_fingerprint_of_a_real_engine_config():
    """model_fingerprint reads what a real VllmConfig has (test_handshake.py
    covers the items with a stand-in)."""
    from vllm.afd.adapter.model.fingerprint import model_fingerprint

    fp = model_fingerprint(parse("--dtype", "float32").create_engine_config())
    assert fp["architecture"] == "Qwen3MoeForCausalLM" and fp["dtype"] == "float32"
    assert fp["num_experts"] == "8" and fp["quantization"] == "none"
    assert fp["weights"] != "unavailable" and len(fp["weights"]) == 32


SECURE = "set VLLM_AFD_TOKEN (or AFDConfig.token_file) to the same value on both roles"


@pytest.mark.parametrize("values", [
    {"role": "ffn", "connector": "tcp", "host": "0.0.0.0"},
    {"role": "ffn", "connector": "nccl", "host": "10.1.2.3"},
    {"role": "ffn", "connector": "tcp", "host": "::"},
    {"role": "ffn", "connector": "tcp", "host": "ffn.example"},
    {"role": "ffn", "connector": "shm", "host": "0.0.0.0",
     "connector_extra_config": {"notify": "tcp"}},
])
def test_ffn_beyond_loopback_needs_a_secret(values, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_AFD_TOKEN", raising=False)
    with pytest.raises(ValueError) as e:
        AFDConfig(**values)
    assert (f"AFDConfig.host: the FFN server would listen on {values['host']}, reachable "
            f"from other machines, without a secret: {SECURE}, or set "
            f"AFDConfig.allow_insecure=true") in str(e.value)
    assert AFDConfig(**values, allow_insecure=True).allow_insecure
    token = tmp_path / "token"
    token.write_text("x" * 32)
    assert AFDConfig(**values, token_file=str(token)).token_file == str(token)
    monkeypatch.setenv("VLLM_AFD_TOKEN", "y" * 32)
    AFDConfig(**values)


def test_ffn_hosts_beyond_loopback_need_a_secret(monkeypatch):
    monkeypatch.delenv("VLLM_AFD_TOKEN", raising=False)
    values = {"role": "ffn", "connector": "tcp", "num_ffn_ranks": 2,
              "ffn_hosts": ["127.0.0.1", "10.1.2.3"]}
    with pytest.raises(ValueError, match=r"AFDConfig.ffn_hosts: the FFN server would "
                                         r"listen on 10\.1\.2\.3"):
        AFDConfig(**values)
    cfg = AFDConfig(**values, allow_insecure=True)
    link = cfg.link_config()
    assert (link.host_of(0), link.host_of(1)) == ("127.0.0.1", "10.1.2.3")
    assert AFDConfig(role="ffn", connector="tcp", num_ffn_ranks=2,
                     ffn_hosts=["127.0.0.1", "127.0.0.2"]).link_config().host_of(1) == "127.0.0.2"


@pytest.mark.parametrize("values", [
    {"role": "ffn", "connector": "tcp", "host": "127.0.0.1"},
    {"role": "ffn", "connector": "tcp", "host": "127.0.0.2"},
    {"role": "ffn", "connector": "tcp", "host": "::1"},
    {"role": "ffn", "connector": "tcp", "host": "localhost"},
    {"role": "ffn", "connector": "shm", "host": "0.0.0.0"},  # abstract unix socket
    {"role": "ffn", "connector": "loopback", "host": "0.0.0.0"},
    {"role": "attention", "connector": "tcp", "host": "10.1.2.3"},  # dials, never listens
])
def test_local_or_dialing_needs_no_secret(values, monkeypatch):
    monkeypatch.delenv("VLLM_AFD_TOKEN", raising=False)
    assert not AFDConfig(**values).allow_insecure


def test_secret_set_twice_or_empty_is_refused(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("x" * 32)
    monkeypatch.setenv("VLLM_AFD_TOKEN", "y" * 32)
    with pytest.raises(ValueError, match="the AFD secret is set twice, by VLLM_AFD_TOKEN and "
                       "by token_file"):
        AFDConfig(token_file=str(token))
    monkeypatch.delenv("VLLM_AFD_TOKEN")
    with pytest.raises(ValueError, match="AFDConfig.token_file: must not be empty"):
        AFDConfig(token_file=" ")
    cfg = afd_of(parse("--afd-config", f'{{"token_file": "{token}", "allow_insecure": true}}'))
    assert (cfg.token_file, cfg.allow_insecure) == (str(token), True)
    # Neither changes the computation graph.
    assert cfg.compute_hash() == AFDConfig().compute_hash()


@pytest.mark.parametrize("changes, message", [
    ({"port": 0}, "port: 0 is not in 1-65535"),
    ({"num_ffn_ranks": 0}, "num_ffn_ranks: must be >= 1, got 0"),
    ({"num_ubatches": 9}, "num_ubatches: 9 is not in 1-4"),
    ({"timeout_s": 0}, "timeout_s: must be > 0, got 0"),
    ({"ffn_hosts": ["a", "b"]}, "ffn_hosts: 2 addresses for 1 FFN ranks (num_ffn_ranks)"),
    ({"ffn_hosts": [""]}, "ffn_hosts: an address must not be empty"),
    ({"ffn_pool": ["no-port"]}, "ffn_pool: 'no-port' is not host:port"),
])
def test_the_link_fields_are_checked_once_for_both_configs(changes, message):
    """AFDConfig (the user's) and LinkConfig (the data plane's, which the
    harness builds directly) refuse the fields they share alike, naming
    themselves: one set of checks (transport/config.py check_link_fields)."""
    from vllm.afd.transport.config import LinkConfig

    for cls in (AFDConfig, LinkConfig):
        with pytest.raises(ValueError) as refused:
            cls(role="attention", **changes)
        assert f"{cls.__name__}.{message}" in str(refused.value), (cls, str(refused.value))
