"""Bad input to the ``hspmd`` command line: always one ``error:`` line and a non-zero exit, never a traceback.

A table of more than a hundred bad inputs (every subcommand, every kind of argument and file), then random ones
from hypothesis, all run in this process through ``cli.main`` (fast: nothing may start a worker or contact a
host); a few subprocess checks cover what only a real process shows (Ctrl-C -> 130, ``--debug``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hspmd_sdk.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "hspmd_sdk" / "examples"
TINY_PP2 = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 1]}, {"devices": [1], "layers": [2, 3]}],
                           "micro_batch_size": 2, "num_micro_batches": 2}]}
BIG_PP2 = {"pipelines": [{"stages": [{"devices": [0], "layers": [0, 39]}, {"devices": [1], "layers": [40, 79]}],
                          "micro_batch_size": 1, "num_micro_batches": 2}]}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad")
    out: dict[str, str] = {"DIR": str(d), "MISSING": str(d / "missing.json"), "NODIR": str(d / "no" / "x.json")}

    def put(name: str, data: str | bytes) -> None:
        p = d / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        out[name.upper().replace(".", "_")] = str(p)

    put("deep.json", "[" * 100_000 + "]" * 100_000)
    put("deepobj.json", '{"a":' * 50_000 + "1" + "}" * 50_000)
    put("binary.bin", bytes(range(256)) * 4)
    put("latin1.json", '{"pipelines": "\xe9t\xe9"}'.encode("latin-1"))
    put("bigint.json", '{"pipelines": [{"stages": [{"devices": [' + "9" * 4400 + '], "layers": [0, 1]}]}]}')
    put("empty.json", "")
    put("list.json", "[1, 2]")
    put("badtype.json", '{"pipelines": 3}')
    put("nopipes.json", '{"pipelines": []}')
    mb = {"micro_batch_size": 1, "num_micro_batches": 1}
    put("negdev.json", json.dumps({"pipelines": [{"stages": [{"devices": [-1], "layers": [0, 3]}], **mb}]}))
    put("hugedev.json", json.dumps({"pipelines": [{"stages": [{"devices": [10**30], "layers": [0, 3]}], **mb}]}))
    put("badplan.json", '{"annotations": {"w": "garbage"}}')
    put("nonodes.json", '{"nodes": []}')
    put("dupranks.json", json.dumps({"nodes": [{"host": "a", "kind": "cpu", "ranks": [0, 0]}]}))
    put("tiny_pp2.json", json.dumps(TINY_PP2))
    put("big_pp2.json", json.dumps(BIG_PP2))
    put("local2.json", json.dumps({"nodes": [{"host": "localhost", "kind": "cpu", "ranks": [0, 1]}]}))
    put("hf_dup.txt", "127.0.0.9 slots=2 slots=3\n")
    put("hf_abc.txt", "127.0.0.9 slots=abc\n")
    put("hf_zero.txt", "127.0.0.9 slots=0\n")
    put("hf_huge.txt", "127.0.0.9 slots=1000000\n")
    put("hf_empty.txt", "# nothing\n")
    put("hf_gpus.txt", "127.0.0.9 gpus=2\n")
    put("hf_ok.txt", "127.0.0.9 slots=1\n")
    put("hosts_list.json", "[1]")
    put("hosts_port.json", json.dumps({"127.0.0.9": {"port": 0}}))
    put("hosts_env.json", json.dumps({"127.0.0.9": {"env": {"1BAD": "x"}}}))
    put("len_abc.txt", "12\nabc\n")
    put("len_json.json", '[1, "x"]')
    put("len_neg.txt", "-5\n")
    put("len_zero.txt", "0\n")
    put("cost_bad.json", '{"no_such_field": 1}')
    return out


S, T = "tiny_pp2", "TINY_PP2_JSON"
# (argv with {PLACEHOLDERS}, a fragment the error must contain)
CASES: list[tuple[list[str], str]] = [
    # ---- validate / show: files of every bad kind
    (["validate", "{MISSING}"], "no such file"),
    (["validate", "{DEEP_JSON}"], "nested too deeply"),
    (["validate", "{DEEPOBJ_JSON}"], "nested too deeply"),
    (["validate", "{BINARY_BIN}"], "not UTF-8"),
    (["validate", "{LATIN1_JSON}"], "not UTF-8"),
    (["validate", "{BIGINT_JSON}"], "digits"),
    (["validate", "{EMPTY_JSON}"], "not valid JSON"),
    (["validate", "{LIST_JSON}"], "not a strategy, plan or cluster"),
    (["validate", "{BADTYPE_JSON}"], "pipelines"),
    (["validate", "{NOPIPES_JSON}"], "pipelines"),
    (["validate", "{NEGDEV_JSON}"], "devices"),
    (["validate", "{HUGEDEV_JSON}"], "devices"),
    (["validate", "{BADPLAN_JSON}"], "annotations"),
    (["validate", "{NONODES_JSON}"], "nodes"),
    (["validate", "{DUPRANKS_JSON}"], "repeated"),
    (["validate", "{DIR}"], "cannot read"),
    (["validate", "x" * 5000], "no such file"),
    (["validate", "a\0b"], "no such file"),
    (["validate", "{%s}" % T, "--model", "nonsense"], "nonsense"),
    (["validate", "{%s}" % T, "--model", "{DEEP_JSON}"], "model"),
    (["validate", "{%s}" % T, "--model", "{BINARY_BIN}"], "model"),
    (["validate", "{%s}" % T, "--cluster", "{MISSING}"], "no such file"),
    (["validate", "{%s}" % T, "--cluster", "{BINARY_BIN}"], "cluster"),
    (["validate", "{%s}" % T, "--cluster", "{DEEP_JSON}"], "cluster"),
    (["validate", "{%s}" % T, "--global-batch", "0"], "out of range"),
    (["validate", "{%s}" % T, "--global-batch", "-3"], "out of range"),
    (["validate", "{%s}" % T, "--global-batch", "abc"], "not an integer"),
    (["validate", "{%s}" % T, "--global-batch", "9" * 4400], "not an integer"),
    (["validate", "{BIG_PP2_JSON}", "--model", "llama-70b", "--cluster", "{LOCAL2_JSON}"], "GiB/rank"),
    (["validate", "{%s}" % T, "--model", "tiny", "--cluster", "{LOCAL2_JSON}", "--global-batch", "5"],
     "global batch is 5"),
    (["show", "{DEEP_JSON}"], "nested too deeply"),
    (["show", "{BINARY_BIN}"], "not UTF-8"),
    (["show", "{MISSING}"], "no such file"),
    (["show", "{LIST_JSON}"], "not a strategy"),
    (["show", "{%s}" % T, "--model", "nonsense"], "nonsense"),
    # ---- resolve
    (["resolve", "[0,1] X", "[0] R", "--shape", "8"], "cannot read DS token"),
    (["resolve", "[0,1] P2", "garbage", "--shape", "8"], "annotation"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "abc"], "--shape"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "0,4"], "out of range"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "-1"], "out of range"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "1e9"], "--shape"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "9" * 30 + ",2"], "out of range"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "1099511627777"], "out of range"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", ",".join(["2"] * 17)], "16 dimensions"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "1048576,1048576,1048576"], "elements"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "4,4", "--dtype", "int77"], "unknown dtype"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "4,4", "--dtype", ""], "dtype"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "4,4", "--cluster", "{MISSING}"], "no such file"),
    (["resolve", "[0,1] P2", "[0,1] S0x2", "--shape", "4,4", "--cluster", "{BINARY_BIN}"], "cluster"),
    (["resolve", "[0,99999999999] P2", "[0,1] S0x2", "--shape", "4,4"], "out of range"),
    (["resolve", "[0-99999999] D1", "[0] R", "--shape", "4"], "out of range"),
    (["resolve", "[0,1] P2", "[0,1] S0x3", "--shape", "4"], "spans 3"),
    (["resolve", "[0,1] P2", "[0,1] S0x2"], "--shape"),
    # ---- data / train
    (["data", "show", "{MISSING}"], "not a prepared corpus"),
    (["data", "prepare", "{MISSING}", "--out", "{MISSING}", "--train-tokenizer", "300"], "no such input file"),
    (["data", "prepare", "{MISSING}", "--out", "{MISSING}", "--train-tokenizer", "300", "--val-fraction", "2"],
     "--val-fraction"),
    (["train", "{MISSING}"], "cannot be read"),
    (["train", "{BINARY_BIN}"], "train config"),
    # ---- plan
    (["plan", "--cluster", "H800:abc", "--model", "tiny"], "KIND:COUNT"),
    (["plan", "--cluster", "H800:0", "--model", "tiny"], "counts"),
    (["plan", "--cluster", "H800:-1", "--model", "tiny"], "KIND:COUNT"),
    (["plan", "--cluster", "H800:", "--model", "tiny"], "KIND:COUNT"),
    (["plan", "--cluster", ":8", "--model", "tiny"], "KIND:COUNT"),
    (["plan", "--cluster", "FOO:8", "--model", "tiny"], "unknown device kind"),
    (["plan", "--cluster", "H800:100000000", "--model", "tiny"], "KIND:COUNT"),
    (["plan", "--cluster", "H800:100000,H20:100000", "--model", "tiny"], "ranks is more than"),
    (["plan", "--cluster", "H800:8,H800:8", "--model", "tiny"], "twice"),
    (["plan", "--cluster", "{MISSING}", "--model", "tiny"], "no such file"),
    (["plan", "--cluster", "{DEEP_JSON}", "--model", "tiny"], "cluster"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "-o", "{NODIR}"], "does not exist"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "-o", "{DIR}"], "is a folder"),
    (["plan", "--cluster", "H800:8", "--model", "bogus"], "bogus"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--global-batch", "0"], "out of range"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--seq-len", "0"], "out of range"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--seq-len", "9" * 30], "out of range"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--scenario", "elastic"], "--strategy"),
    (["plan", "--cluster", "local_4", "--model", "tiny", "--scenario", "elastic", "--strategy",
      "example_hetero_tiny", "--failed", "999"], "rank 999 is not in the cluster"),
    (["plan", "--cluster", "local_4", "--model", "tiny", "--scenario", "elastic", "--strategy",
      "example_hetero_tiny", "--failed", "abc"], "cannot read"),
    (["plan", "--cluster", "local_4", "--model", "tiny", "--scenario", "elastic", "--strategy",
      "example_hetero_tiny", "--failed", "0-99999999999"], "cannot read"),
    (["plan", "--cluster", "local_4", "--model", "tiny", "--scenario", "elastic", "--strategy",
      "example_hetero_tiny", "--failed", "0-3"], "every rank"),
    (["plan", "--cluster", "local_4", "--model", "tiny", "--scenario", "elastic", "--strategy",
      "{MISSING}", "--failed", "1"], "no such file"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--scenario", "mixed"], "--lengths"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--scenario", "mixed", "--lengths", "{MISSING}"],
     "no such file"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--scenario", "mixed", "--lengths", "{BINARY_BIN}"],
     "not UTF-8"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--scenario", "mixed", "--lengths", "{LEN_ABC_TXT}"],
     "sequence lengths"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--scenario", "mixed", "--lengths", "{LEN_JSON_JSON}"],
     "sequence lengths"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--scenario", "mixed", "--lengths", "{LEN_NEG_TXT}"],
     "out of range"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--scenario", "mixed", "--lengths", "{LEN_ZERO_TXT}"],
     "out of range"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--scenario", "mixed", "--lengths", "{EMPTY_JSON}"],
     "no sequence lengths"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--cost", "{MISSING}"], "no such file"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--cost", "{BINARY_BIN}"], "not UTF-8"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--cost", "{COST_BAD_JSON}"], "no_such_field"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--tokens-per-batch", "0"], "out of range"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--context-len", "0"], "out of range"),
    (["plan", "--cluster", "H800:8", "--model", "tiny", "--scenario", "bogus"], "invalid choice"),
    # ---- simulate
    (["simulate", "table11_c2", "--seq-len", "0"], "out of range"),
    (["simulate", "table11_c2", "--seq-len", "-1"], "out of range"),
    (["simulate", "table11_c2", "--global-batch", "0"], "out of range"),
    (["simulate", "table11_c2", "--global-batch", "7"], "global batch"),
    (["simulate", "table11_c2", "--seq-len", "65536"], "run out of memory"),
    (["simulate", "{MISSING}"], "no such file"),
    (["simulate", "{%s}" % T], "--model/--cluster"),
    (["simulate", "{%s}" % T, "--model", "tiny", "--cluster", "H800:abc"], "KIND:COUNT"),
    (["simulate", "table11_c2", "--cost", "{COST_BAD_JSON}"], "no_such_field"),
    # ---- run (nothing may start a worker)
    (["run", "{%s}" % T, "--local", "0"], "out of range"),
    (["run", "{%s}" % T, "--local", "-1"], "out of range"),
    (["run", "{%s}" % T, "--local", "abc"], "not an integer"),
    (["run", "{%s}" % T, "--local", "1000000"], "out of range"),
    (["run", "{%s}" % T, "--local", "2", "--steps", "0"], "out of range"),
    (["run", "{%s}" % T, "--local", "2", "--lr", "nan"], "finite number"),
    (["run", "{%s}" % T, "--local", "2", "--lr", "inf"], "finite number"),
    (["run", "{%s}" % T, "--local", "2", "--lr", "-1"], "finite number"),
    (["run", "{%s}" % T, "--local", "2", "--lr", "0"], "finite number"),
    (["run", "{%s}" % T, "--local", "2", "--seq-len", "0"], "out of range"),
    (["run", "{%s}" % T, "--local", "2", "--seed", "-1"], "out of range"),
    (["run", "{%s}" % T, "--local", "2", "--timeout", "0"], "finite number"),
    (["run", "{%s}" % T, "--local", "2", "--timeout", "nan"], "finite number"),
    (["run", "{%s}" % T, "--local", "2", "--stall", "0.1"], "at least two heartbeats"),
    (["run", "{MISSING}", "--local", "2"], "no such file"),
    (["run", "{BINARY_BIN}", "--local", "2"], "strategy"),
    (["run", "{%s}" % T, "--local", "2", "--model", "bogus"], "bogus"),
    (["run", "{%s}" % T, "--local", "2", "--data", "bogus"], "stdlib or synthetic"),
    (["run", "--local", "2"], "--programs DIR"),
    (["run", "{%s}" % T, "--local", "2", "--padding"], "--padding: pads the micro-batches of --programs"),
    (["run", "{%s}" % T, "--local", "2", "--programs", "{MISSING}"], "not both"),
    (["run", "--local", "2", "--programs", "{MISSING}", "--tokens-per-step", "64"], "not a folder"),
    (["run", "--local", "2", "--programs", "{DIR}", "--tokens-per-step", "64"], "no candidate_"),
    (["run", "{BIG_PP2_JSON}", "--local", "2", "--model", "llama-70b"], "GB of RAM"),
    (["run", "{%s}" % T, "--local", "2", "--seq-len", "16000000"], "GB of RAM"),
    (["run", "{%s}" % T, "--local", "100000"], "CPU ranks on"),
    (["run", "{%s}" % T, "--local", "2", "--log-dir", "{BINARY_BIN}/logs"], "cannot write the job's logs"),
    # ---- launch (nothing may contact a host)
    (["launch", "--hostfile", "{MISSING}", "--entry", "m:f"], "no such file"),
    (["launch", "--hostfile", "{BINARY_BIN}", "--entry", "m:f"], "not UTF-8"),
    (["launch", "--hostfile", "{DIR}", "--entry", "m:f"], "cannot read"),
    (["launch", "--hostfile", "{HF_DUP_TXT}", "--entry", "m:f"], "slots is given twice"),
    (["launch", "--hostfile", "{HF_ABC_TXT}", "--entry", "m:f"], "not an integer"),
    (["launch", "--hostfile", "{HF_ZERO_TXT}", "--entry", "m:f"], "must be >= 1"),
    (["launch", "--hostfile", "{HF_HUGE_TXT}", "--entry", "m:f"], "too many"),
    (["launch", "--hostfile", "{HF_EMPTY_TXT}", "--entry", "m:f"], "no hosts"),
    (["launch", "--hostfile", "{HF_GPUS_TXT}", "--entry", "m:f"], "cannot read 'gpus=2'"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "os:system;x"], "module:function"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", ""], "module:function"),
    (["launch", "--hostfile", "{HF_OK_TXT}"], "give a strategy to train"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--ssh-hosts", "{MISSING}"], "SSH hosts"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--ssh-hosts", "{BINARY_BIN}"], "SSH hosts"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--ssh-hosts", "{DEEP_JSON}"], "nested too deeply"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--ssh-hosts", "{HOSTS_LIST_JSON}"], "JSON object"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--ssh-hosts", "{HOSTS_PORT_JSON}"], "port"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--ssh-hosts", "{HOSTS_ENV_JSON}"], "env"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--ssh-port", "0"], "out of range"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--steps", "0"], "out of range"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--lr", "nan"], "finite number"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--timeout", "-1"], "finite number"),
    (["launch", "--hostfile", "{HF_OK_TXT}", "--entry", "m:f", "--stall", "0.5"], "at least two heartbeats"),
    # ---- demo, checkpoint
    (["demo", "--steps", "0"], "out of range"),
    (["demo", "--seed", "x"], "not an integer"),
    (["checkpoint"], "required"),
    (["checkpoint", "show", "{MISSING}"], "no such checkpoint directory"),
    (["checkpoint", "export", "{MISSING}", "--hf", "{NODIR}"], "no such checkpoint directory"),
    # ---- the top level
    (["bogus"], "invalid choice"),
    (["validate"], "required"),
]


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def fill(argv: list[str], files: dict[str, str]) -> list[str]:
    return [a.format(**files) if "{" in a else a for a in argv]


def test_the_table_feeds_bad_input_to_every_command_that_takes_any() -> None:
    """Against the CLI's own parser, not this table's size: a command added without bad-input cases fails here."""
    import argparse

    from hspmd_sdk.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    takes_input = {name for name, p in sub.choices.items()
                   if any(not isinstance(a, argparse._HelpAction) for a in p._actions)}
    assert "run" in takes_input and "examples" not in takes_input  # the parser is read as meant
    missing = takes_input - {argv[0] for argv, _ in CASES}
    assert not missing, f"no bad-input case for: {sorted(missing)}"


@pytest.mark.timeout(240)
def test_every_bad_input_is_one_error_line_without_traceback(capsys: pytest.CaptureFixture[str],
                                                             files: dict[str, str]) -> None:
    """All cases in one test (one module import, one fixture); a failure lists every case that failed."""
    failed = []
    for argv, fragment in CASES:
        args = fill(argv, files)
        t0 = time.monotonic()
        code, out, err = run_cli(capsys, args)
        took = time.monotonic() - t0
        lines = [line for line in err.splitlines() if line.strip()]
        ok = (code not in (0, None) and "Traceback" not in err + out and fragment in err
              and any(line.startswith("error:") or ": error:" in line for line in lines) and took < 30)
        if not ok:
            failed.append(f"{argv} -> code {code} in {took:.1f} s; want {fragment!r}; stderr: {err[-600:]!r}")
    assert not failed, "\n".join(failed)


# ---- random input ---------------------------------------------------------------------------------------------
#: Per command: the options it takes (with a value) and its flags; values are random, often close to valid.
OPTIONS = {
    "validate": (["--model", "--cluster", "--global-batch"], ["--no-memory-check"]),
    "show": (["--model", "--cluster"], []),
    "simulate": (["--model", "--cluster", "--global-batch", "--seq-len", "--cost"], ["--timeline"]),
    "resolve": (["--shape", "--dtype", "--cluster"], []),
    "plan": (["--model", "--cluster", "--global-batch", "--seq-len", "--scenario", "--strategy", "--failed",
              "--lengths", "--tokens-per-batch", "--context-len", "--cost"], ["--no-zero1"]),
}
NEAR_VALID = ["tiny", "llama-7b", "llama-70b", "local_4", "h20_31", "H800:8", "H800:8,H20:8", "cpu:2", "4,4",
              "64,32", "float32", "bfloat16", "nan", "-1", "0", "1", "3", "64", "1e400", "table11_c2",
              "example_hetero_tiny", "hetero", "elastic", "mixed", "0-3", "31", "1,2"]
VALUES = st.one_of(st.sampled_from(NEAR_VALID), st.text(max_size=20), st.integers(-10**6, 10**30).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(str))
ANNOTATIONS = st.one_of(st.sampled_from(["[0,1] P2", "[0,1] S0x2", "[0] R", "[0,1,2,3] S1x4", "[0,1] D2",
                                         "[0,3] S1x2 | [5,6] S1x2 ; hdim=0 ratios=1:2"]),
                        st.text(max_size=30))
CONTENT = st.one_of(st.none(), st.binary(max_size=300), st.text(max_size=300),
                    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                                 lambda c: st.lists(c, max_size=4) | st.dictionaries(
                                     st.sampled_from(["pipelines", "stages", "nodes", "annotations", "devices",
                                                      "layers", "ranks", "host", "kind", "micro_batch_size",
                                                      "num_micro_batches"]), c, max_size=4),
                                 max_leaves=20).map(json.dumps))


@pytest.mark.timeout(300)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command=st.sampled_from(sorted(OPTIONS)), data=st.data(), content=CONTENT)
def test_random_input_never_ends_in_a_traceback(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                command: str, data: st.DataObject, content) -> None:
    options, flags = OPTIONS[command]
    argv = [command]
    if command == "resolve":
        argv += [data.draw(ANNOTATIONS), data.draw(ANNOTATIONS)]
    elif command != "plan":
        if content is not None:
            f = tmp_path / "input.json"
            f.write_bytes(content if isinstance(content, bytes) else content.encode())
            argv.append(str(f))
        else:
            argv.append(data.draw(VALUES))
    for opt, value in data.draw(st.lists(st.tuples(st.sampled_from(options), VALUES), max_size=5)):
        argv += [opt, value]
    argv += data.draw(st.lists(st.sampled_from(flags), max_size=1)) if flags else []
    if command == "plan":
        argv += ["-o", str(tmp_path / "no" / "such" / "folder" / "out.json")]  # fails before any planning
    code, out, err = run_cli(capsys, argv)
    assert "Traceback" not in err + out, (argv, err)
    assert code in (0, 1, 2), (argv, code, err)
    if code:
        assert "error" in err, (argv, err)


# ---- real processes -------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_ctrl_c_during_run_exits_130_and_leaves_nothing(tmp_path: Path) -> None:
    strategy = tmp_path / "pp2.json"
    strategy.write_text(json.dumps(TINY_PP2))
    logs = tmp_path / "logs"
    proc = subprocess.Popen([sys.executable, "-m", "hspmd_sdk.cli", "run", str(strategy), "--local", "2",
                             "--steps", "100000", "--data", "synthetic", "--log-dir", str(logs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and "metric: step 2" not in _read(logs / "rank0.log"):
            time.sleep(0.1)
        assert "metric: step 2" in _read(logs / "rank0.log"), "the job did not start"
        pids = _worker_pids(proc.pid)
        assert len(pids) == 2
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal does
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "interrupted" in err and "Traceback" not in err
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "workers were left behind"


def test_debug_shows_the_traceback_and_bad_input_exits_1_in_a_process(tmp_path: Path) -> None:
    bad = tmp_path / "deep.json"
    bad.write_text("[" * 100_000 + "]" * 100_000)
    plain = subprocess.run([sys.executable, "-m", "hspmd_sdk.cli", "validate", str(bad)], capture_output=True,
                           text=True, timeout=60)
    assert plain.returncode == 1 and plain.stderr.startswith("error:") and "Traceback" not in plain.stderr
    debug = subprocess.run([sys.executable, "-m", "hspmd_sdk.cli", "--debug", "validate", str(bad)],
                           capture_output=True, text=True, timeout=60)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _worker_pids(parent: int) -> list[int]:
    """Worker processes of the ``hspmd run`` child: its children, or its fork server's children."""
    procs: dict[int, tuple[int, bytes]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            procs[int(entry)] = (ppid, cmd)
    servers = {p for p, (ppid, cmd) in procs.items()
               if ppid == parent and b"hspmd_sdk.runtime.transports.forkserver_process" in cmd}
    return [p for p, (ppid, cmd) in procs.items()
            if b"hspmd_sdk.runtime.workers.worker" in cmd and (ppid == parent or ppid in servers)]
