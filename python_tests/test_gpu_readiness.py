"""What a GPU build and a device run rely on, checked without a GPU: setup.py's choice of CUDA
architectures, the rule that sends a staged op to its verified kernel on a device that cannot
run the staged one (dblast/kernel_variant.h, asked about devices this machine does not have),
and bench/device_check.sh's stage limits and its SIGINT-then-KILL stop, which must leave
pytest's JUnit report behind."""
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from dblast_ext import ops
from test_build import load_setup_py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_CHECK = os.path.join(ROOT, "bench", "device_check.sh")
CLUSTER_OPS = ("branch_verify", "mixture_verify", "sample_tokens")
OTHER_OPS = ("branch_argmax", "drafter_attention")
KB = 1024
# (compute capability, opt-in shared memory per block) of GPUs the package is built for
A100, A10, L4, H100, B200, RTX_5090 = ((8, 0), 163 * KB), ((8, 6), 99 * KB), ((8, 9), 99 * KB), \
    ((9, 0), 227 * KB), ((10, 0), 227 * KB), ((12, 0), 99 * KB)


# --- setup.py: which architectures a CUDA build compiles for ---------------------------------

def test_a_listed_architecture_wins_over_the_visible_gpu():
    choose = load_setup_py().cuda_arch_list
    assert choose({"TORCH_CUDA_ARCH_LIST": "8.6"}, [(9, 0)]) == "8.6"
    assert choose({"TORCH_CUDA_ARCH_LIST": " 8.0;9.0+PTX "}, []) == "8.0;9.0+PTX"


def test_a_visible_gpu_without_a_list_builds_its_own_architecture():
    choose = load_setup_py().cuda_arch_list
    assert choose({}, [(8, 6)]) == "8.6"  # an A10: pip install . builds sm_86, not the Hopper-only 9.0
    assert choose({}, [(8, 9), (8, 0), (8, 9)]) == "8.0;8.9"  # each visible architecture once
    assert choose({"TORCH_CUDA_ARCH_LIST": "native"}, [(12, 0)]) == "12.0"
    assert choose({"TORCH_CUDA_ARCH_LIST": ""}, [(10, 0)]) == "10.0"


def test_without_a_list_or_a_gpu_the_default_covers_ampere_to_blackwell_with_ptx():
    setup_py = load_setup_py()
    chosen = setup_py.cuda_arch_list({}, [])
    assert chosen == setup_py.DEFAULT_CUDA_ARCHS
    archs = chosen.split(";")
    assert [a.replace("+PTX", "") for a in archs] == ["8.0", "8.6", "8.9", "9.0", "10.0", "12.0"]
    assert archs[-1].endswith("+PTX")  # the newest as PTX too: the driver compiles it for later GPUs


def test_the_documented_default_is_setup_pys():
    doc = open(os.path.join(ROOT, "docs", "development.md")).read()
    assert f"`{load_setup_py().DEFAULT_CUDA_ARCHS}`" in doc


# --- the dispatch rule: staged kernel, or the verified one on a device that cannot run it -----

@pytest.mark.parametrize("gpu", [A100, A10, L4], ids=["A100", "A10", "L4"])
@pytest.mark.parametrize("op", CLUSTER_OPS)
def test_staged_cluster_kernels_fall_back_before_hopper(op, gpu):
    (major, minor), shared = gpu
    chosen = ops.cuda_kernel_for(op, capability=(major, minor), shared_per_block=shared, variant="staged")
    assert chosen == (f"verified (its staged kernel needs compute capability 9.0 and 112 KB of shared memory per "
                      f"block; this GPU has {major}.{minor} and {shared // KB} KB)")


@pytest.mark.parametrize("op", CLUSTER_OPS)
def test_staged_cluster_kernels_need_the_shared_memory_of_a_data_center_gpu(op):
    for gpu in (H100, B200):
        assert ops.cuda_kernel_for(op, capability=gpu[0], shared_per_block=gpu[1], variant="staged") == "staged"
    # an RTX 5090 has clusters but 99 KB per block: a slice cache and the reductions' state do not fit
    assert ops.cuda_kernel_for(op, capability=RTX_5090[0], shared_per_block=RTX_5090[1],
                               variant="staged").startswith("verified (")


@pytest.mark.parametrize("op", OTHER_OPS)
def test_the_other_staged_kernels_run_from_ampere_on(op):
    for gpu in (A100, A10, L4, H100, B200, RTX_5090):
        assert ops.cuda_kernel_for(op, capability=gpu[0], shared_per_block=gpu[1], variant="staged") == "staged"
    assert ops.cuda_kernel_for(op, capability=(7, 5), shared_per_block=64 * KB, variant="staged") == \
        "verified (its staged kernel needs compute capability 8.0; this GPU has 7.5)"


def promoted(op):
    """Whether a device run promoted op's staged kernel (csrc/cuda/staged/promoted.h)."""
    constant = "kPromoted" + "".join(word.title() for word in op.split("_"))
    return f"{constant} = true;" in open(os.path.join(ROOT, "csrc", "cuda", "staged", "promoted.h")).read()


@pytest.mark.parametrize("op", CLUSTER_OPS + OTHER_OPS)
def test_the_verified_variant_runs_staged_kernels_only_once_promoted(op):
    on_h100 = ops.cuda_kernel_for(op, capability=H100[0], shared_per_block=H100[1], variant="verified")
    assert on_h100 == ("staged" if promoted(op) else "verified")
    on_a10 = ops.cuda_kernel_for(op, capability=A10[0], shared_per_block=A10[1], variant="verified")
    assert on_a10 == "verified" or (promoted(op) and op in CLUSTER_OPS and on_a10.startswith("verified ("))


def test_the_rule_follows_the_variant_in_force():
    with ops.using_cuda_kernels("staged"):
        assert ops.cuda_kernel_for("sample_tokens", capability=H100[0], shared_per_block=H100[1]) == "staged"
    assert ops.cuda_kernels() == "verified"
    assert ops.cuda_kernel_for("sample_tokens", capability=H100[0], shared_per_block=H100[1]) == \
        ("staged" if promoted("sample_tokens") else "verified")


def test_an_unknown_op_or_variant_is_named():
    with pytest.raises(ValueError, match='op must be one of .*got "sparse_verify"'):
        ops.cuda_kernel_for("sparse_verify", capability=(9, 0), shared_per_block=227 * KB, variant="staged")
    with pytest.raises(ValueError, match='variant must be "verified" or "staged", got "fast"'):
        ops.cuda_kernel_for("sample_tokens", capability=(9, 0), shared_per_block=227 * KB, variant="fast")


# --- bench/device_check.sh ----------------------------------------------------------------------

def stage_limits():
    """The header's limits per part: ({stage: seconds}, grace seconds, stated sum)."""
    parts = {}
    for part, stages, total in re.findall(r"^#\s+(part\d): (.*) = (\d+)$", open(DEVICE_CHECK).read(), re.M):
        limits, graces = {}, 0
        for stage in stages.split(", "):
            name, seconds, grace = re.fullmatch(r"(\D+) (\d+)(?: \+ (\d+))?", stage).groups()
            limits[name] = int(seconds)
            graces += int(grace or 0)
        parts[part] = (limits, graces, int(total))
    return parts


def test_the_stage_limits_add_up_and_each_part_fits_eight_minutes():
    parts = stage_limits()
    assert set(parts) == {"part1", "part2"}
    for limits, graces, total in parts.values():
        assert sum(limits.values()) + graces == total <= 480


def test_the_header_names_the_limits_the_script_uses():
    script = open(DEVICE_CHECK).read()
    used = {int(n) for n in re.findall(r"(?:limited|timeout|tests \w+|sanitize \w+) (\d+)\b", script)}
    stated = {s for limits, _, _ in stage_limits().values() for s in limits.values()}
    assert used == stated
    grace = re.search(r"timeout --signal=INT --kill-after=(\d+)", script).group(1)
    assert re.findall(r" \+ (\d+)", "".join(re.findall(r"^#\s+part\d: .*$", script, re.M))) == \
        [grace] * 5  # every pytest stage: SIGINT, then KILL after the grace


def test_the_script_parses_and_refuses_an_unknown_part():
    subprocess.run(["bash", "-n", DEVICE_CHECK], check=True)
    run = subprocess.run(["bash", DEVICE_CHECK, "part3"], capture_output=True, text=True)
    assert run.returncode == 2 and "usage: bash bench/device_check.sh part1|part2" in run.stderr


def test_a_stage_stopped_at_its_limit_still_writes_its_junit_report(tmp_path):
    """device_check.sh stops pytest with SIGINT at a stage's limit: pytest then still writes the
    report of the tests that finished (SIGTERM, timeout's default, left none)."""
    grace = re.search(r"timeout --signal=INT --kill-after=(\d+)", open(DEVICE_CHECK).read()).group(1)
    (tmp_path / "test_stage.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                           "def test_hung():\n    time.sleep(120)\n")
    xml = tmp_path / "tests.xml"
    run = subprocess.run(["timeout", "--signal=INT", f"--kill-after={grace}", "8", sys.executable, "-m", "pytest",
                          "test_stage.py", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 124
    cases = {case.get("name"): case for case in ET.parse(xml).getroot().iter("testcase")}
    assert "test_quick" in cases and cases["test_quick"].find("failure") is None
