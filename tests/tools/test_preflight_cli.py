"""``python -m infera.tools.preflight`` as the runbooks run it: per-host JSON, the fleet's report,
the exit code."""

import json
import subprocess
import sys

import pytest

from infera.tools.preflight.cli import main
from tests.tools.fake_node import fake_node

NODE_PROBES = ["--gpu", "--network", "--firmware", "--topology", "--fabric"]


def sections(path):
    return {name: [f["level"] for f in found] for name, found in json.loads(path.read_text())["sections"].items()}


def test_a_healthy_node_passes_and_its_report_is_written(tmp_path):
    root = fake_node(tmp_path / "root", rdma={"ionic_0": "4: ACTIVE"})
    dump = tmp_path / "out"
    assert main([*NODE_PROBES, "--dump-path", str(dump)], env={"PREFLIGHT_HOST": "gpu-a"}, root=root) == 0
    assert sections(dump / "gpu-a.json") == {"gpu": ["info"], "network": ["info", "info"], "firmware": ["info"],
                                             "topology": ["info", "info"], "fabric": ["info"]}
    report = (dump / "infera_preflight_report.html").read_text()
    assert "gpu-a" in report and "8 GPUs: gfx942 ×8" in report


def test_a_node_without_gpus_fails_with_exit_code_2(tmp_path):
    root = fake_node(tmp_path / "root", kfd=False)
    assert main(["--gpu", "--dump-path", str(tmp_path / "out")], env={"PREFLIGHT_HOST": "n"}, root=root) == 2


def test_hosts_collected_apart_are_combined_and_the_odd_one_out_is_flagged(tmp_path):
    dump = str(tmp_path / "out")
    for host, driver in (("a", "6.10.5"), ("b", "6.10.5"), ("c", "6.8.0")):
        root = fake_node(tmp_path / host, driver=driver)
        assert main(["--gpu", "--collect-only", "--dump-path", dump], env={"PREFLIGHT_HOST": host}, root=root) == 0
    assert not (tmp_path / "out" / "infera_preflight_report.html").exists()  # --collect-only renders nothing
    assert main(["--render-only", "--dump-path", dump, "--report-file-name", "fleet"], env={}) == 0
    report = (tmp_path / "out" / "fleet.html").read_text()
    assert report.count("amdgpu driver 6.8.0 differs across the fleet") == 1
    assert "amdgpu driver 6.10.5 differs" not in report


def test_the_node_and_image_names_come_from_the_flags_before_the_runbooks_environment(tmp_path):
    root = fake_node(tmp_path / "root")
    env = {"PREFLIGHT_HOST": "from-env", "PREFLIGHT_IMAGE": "env-image"}
    assert main(["--gpu", "--collect-only", "--dump-path", str(tmp_path / "a")], env=env, root=root) == 0
    assert json.loads((tmp_path / "a" / "from-env.json").read_text())["image"] == "env-image"
    argv = ["--gpu", "--collect-only", "--dump-path", str(tmp_path / "b"), "--host-name", "gpu-7", "--image", "rocm:x"]
    assert main(argv, env=env, root=root) == 0
    assert json.loads((tmp_path / "b" / "gpu-7.json").read_text())["image"] == "rocm:x"


def test_nothing_to_render_is_an_error(tmp_path):
    assert main(["--render-only", "--dump-path", str(tmp_path)], env={}) == 2


def test_the_runbooks_module_path_runs_on_this_machine(tmp_path):
    r = subprocess.run([sys.executable, "-m", "infera.tools.preflight", "--host", "--network", "--dump-path",
                        str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env={"PREFLIGHT_HOST": "ci", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr  # no probe of those two fails a node
    assert set(sections(tmp_path / "ci.json")) == {"host", "network"}
    assert (tmp_path / "infera_preflight_report.html").exists()
    r = subprocess.run([sys.executable, "-m", "infera.tools.preflight", "--storage-gb", "-1"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--storage-gb (env INFERA_PREFLIGHT_STORAGE_GB)" in r.stderr


def test_flags_that_cannot_work_are_refused_before_any_probe_runs(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, says in ((["--host", "--dump-path", str(afile)], f"{afile} is a file: give a directory"),
                       (["--render-only", "--collect-only"], "exclude each other: give one")):
        with pytest.raises(SystemExit) as exit_:
            main(argv, env={"PREFLIGHT_HOST": "n"})
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert says in err and "[preflight]" not in err  # no probe ran
