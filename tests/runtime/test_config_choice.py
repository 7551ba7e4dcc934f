"""Which tune-config file a GPU gets (``runtime.config_choice``): its own, tuned here or
shipped; else the nearest tuned GPU of its compute capability; else default.yaml, with the
command that tunes it. Fake device names and properties stand for the GPUs."""

import logging

import pytest

from gemslib import runtime
from gemslib.runtime import configs

H100 = runtime.Hardware((9, 0), 132, 79.1)
H200 = runtime.Hardware((9, 0), 132, 139.8)


def _gpu_file(directory, name, hardware):
    major, minor = hardware.capability
    path = directory / f"{name}.yaml"
    path.write_text(f"schema: 1\ndevice: {name}\ntuned:\n  gpu: '{name}'\n"
                    f"  capability: '{major}.{minor}'\n  multiprocessors: "
                    f"{hardware.multiprocessors}\n  memory_gib: {hardware.memory_gib}\nops: {{}}\n")
    return path


@pytest.fixture
def gpus(tmp_path, monkeypatch):
    """A shipped folder with default.yaml and the files of an H100 and an H200, an empty user
    cache, and ``gpu(name, hardware)`` to make the current device that one."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "default.yaml").write_text("schema: 1\ndevice: default\nops: {}\n")
    _gpu_file(shipped, "nvidia_h100_80gb_hbm3", H100)
    _gpu_file(shipped, "nvidia_h200", H200)
    monkeypatch.setattr(configs, "shipped_configs_dir", lambda: shipped)
    monkeypatch.setenv("GEMSLIB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(runtime.CONFIG_ENV, raising=False)

    def gpu(name, hardware):
        monkeypatch.setattr(configs, "device_name", lambda: name)
        monkeypatch.setattr(configs, "current_hardware", lambda: hardware)
        configs.forget_loaded()

    yield shipped, gpu
    configs.forget_loaded()


def test_a_shipped_gpu_takes_its_own_file(gpus):
    shipped, gpu = gpus
    gpu("nvidia_h200", H200)
    assert runtime.config_choice() == (shipped / "nvidia_h200.yaml", "shipped for nvidia_h200")


@pytest.mark.parametrize("name, hardware, nearest", [
    ("nvidia_h100_pcie", runtime.Hardware((9, 0), 114, 79.2), "nvidia_h100_80gb_hbm3"),
    ("nvidia_h800", runtime.Hardware((9, 0), 132, 79.3), "nvidia_h100_80gb_hbm3"),
    ("nvidia_h20", runtime.Hardware((9, 0), 78, 95.0), "nvidia_h100_80gb_hbm3"),
    ("nvidia_gh200_480gb", runtime.Hardware((9, 0), 132, 140.5), "nvidia_h200"),
    ("nvidia_h100_nvl", runtime.Hardware((9, 0), 132, 93.1), "nvidia_h100_80gb_hbm3"),
])
def test_an_unlisted_gpu_takes_the_nearest_of_its_architecture_and_says_so(
        gpus, caplog, name, hardware, nearest):
    shipped, gpu = gpus
    gpu(name, hardware)
    with caplog.at_level(logging.INFO, logger="gemslib.runtime"):
        path, why = runtime.config_choice()
    assert path == shipped / f"{nearest}.yaml"
    assert f"no file for {name}" in why and nearest in why and "sm_90" in why
    assert "python -m gemslib.tune --user" in why
    assert str(path) in caplog.text and why in caplog.text


def test_another_architecture_takes_the_defaults_and_the_command_that_tunes_it(gpus):
    shipped, gpu = gpus
    gpu("nvidia_a100_sxm4_80gb", runtime.Hardware((8, 0), 108, 79.2))
    path, why = runtime.config_choice()
    assert path == shipped / "default.yaml"
    assert "sm_80" in why and "python -m gemslib.tune --user" in why


def test_a_file_tuned_on_this_machine_comes_before_the_shipped_one(gpus):
    shipped, gpu = gpus
    own = runtime.user_configs_dir() / "nvidia_h200.yaml"
    own.parent.mkdir(parents=True)
    _gpu_file(own.parent, "nvidia_h200", H200)
    gpu("nvidia_h200", H200)
    assert runtime.config_choice() == (own, "tuned on this machine for nvidia_h200")
    assert runtime.active_configs()[0].path == own


def test_the_environment_variable_comes_first(gpus, monkeypatch):
    shipped, gpu = gpus
    gpu("nvidia_h100_pcie", runtime.Hardware((9, 0), 114, 79.2))
    chosen = shipped / "nvidia_h200.yaml"
    monkeypatch.setenv(runtime.CONFIG_ENV, str(chosen))
    assert runtime.config_choice() == (chosen, f"${runtime.CONFIG_ENV}")


def test_the_choice_follows_a_changed_environment(gpus, monkeypatch):
    shipped, gpu = gpus
    gpu("nvidia_h100_pcie", runtime.Hardware((9, 0), 114, 79.2))
    assert runtime.config_path() == shipped / "nvidia_h100_80gb_hbm3.yaml"
    monkeypatch.setenv(runtime.CONFIG_ENV, str(shipped / "nvidia_h200.yaml"))
    assert runtime.config_path() == shipped / "nvidia_h200.yaml"


def test_the_environment_line_names_the_file_and_why(gpus):
    from gemslib.__main__ import describe_environment

    shipped, gpu = gpus
    gpu("nvidia_h800", runtime.Hardware((9, 0), 132, 79.3))
    line = next(line for line in describe_environment() if line.startswith("tune config:"))
    assert str(shipped / "nvidia_h100_80gb_hbm3.yaml") in line
    assert "no file for nvidia_h800" in line


def test_shipped_gpu_files_record_their_hardware():
    """Every shipped GPU file says which GPU it was tuned on, so unlisted GPUs can find it."""
    files = [p for p in runtime.shipped_configs_dir().glob("*.yaml") if p.name != "default.yaml"]
    assert files and set(configs._shipped_hardware()) == set(files)


def test_the_tuner_s_user_file_and_out_exclude_each_other(capsys, tmp_path):
    from gemslib import tune

    with pytest.raises(SystemExit) as stop:
        tune.main(["--user", "--out", str(tmp_path / "x.yaml")])
    assert stop.value.code == 2 and "--user and --out" in capsys.readouterr().err
