"""Every entry point sees every family: built-ins without importing a domain, families of an
installed package (the ``dspzoo.families`` entry point) and of ``DSPZOO_FAMILIES``; loading a
model does not import the CLI. Each case runs in a fresh interpreter (what is imported matters).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PLUGIN = '''
"""A user's model family, registered with dspzoo's public registry API."""
from dataclasses import dataclass

from torch import nn

from dspzoo.zoo import register_config, register_family


@dataclass(frozen=True)
class WidgetConfig:
    width: int = 8
    depth: int = 2


class Widget(nn.Module):
    def __init__(self, config: WidgetConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.Sequential(*(nn.Linear(config.width, config.width) for _ in range(config.depth)))


register_family("{family}", Widget, WidgetConfig)
register_config("{family}", "mini", WidgetConfig())
register_config("{family}", "wide", WidgetConfig(width=64))
'''


def _python(code: str, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-c", textwrap.dedent(code)], env=env)


def _run(cmd: list[str], *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "DSPZOO_FAMILIES"}
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full_env)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _installed_plugin(site: Path, family: str) -> None:
    """A package ``widgets_pkg`` on ``site`` with the dist-info pip writes for it: METADATA and
    an ``entry_points.txt`` declaring the ``dspzoo.families`` entry point."""
    pkg = site / "widgets_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "zoo.py").write_text(PLUGIN.format(family=family))
    dist = site / "widgets_pkg-0.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: widgets-pkg\nVersion: 0.3\n")
    (dist / "entry_points.txt").write_text("[dspzoo.families]\nwidgets = widgets_pkg.zoo\n")


def test_importing_the_zoo_imports_no_domain_and_create_model_finds_builtins() -> None:
    out = _ok(
        _python(
            """
            import sys
            import dspzoo.zoo
            from dspzoo.zoo import create_model, get_config
            loaded = sorted(m for m in sys.modules if m.startswith("dspzoo.domains"))
            print("after import:", loaded)
            model = create_model("evoformer-tiny")
            print(type(model).__name__, get_config("weathertx-tiny").hidden)
            print("protein" in str(sorted(sys.modules)))
            """
        )
    )
    assert "after import: []" in out
    assert "Evoformer" in out and "\nTrue" in out


def test_loading_a_model_does_not_import_the_cli() -> None:
    out = _ok(
        _python(
            """
            import sys
            import dspzoo.zoo.pretrained
            assert "dspzoo.zoo.cli" not in sys.modules, "import"
            from dspzoo.zoo import from_pretrained
            model = from_pretrained("weathertx-small-a1b-e1")
            print(type(model).__name__, sorted(m for m in sys.modules if "cli" in m))
            """
        )
    )
    assert out.split()[0] == "WeatherTransformer"
    assert "dspzoo.zoo.cli" not in out and "dspzoo.zoo.run_cli" not in out


def test_an_installed_packages_entry_point_reaches_the_cli_and_create_model(
    tmp_path: Path,
) -> None:
    _installed_plugin(tmp_path, "widget")
    env = {"PYTHONPATH": str(tmp_path)}
    listing = _ok(_run([sys.executable, "-m", "dspzoo", "list"], env=env))
    rows = dict(line.split() for line in listing.splitlines())
    assert rows["widget-mini"] == "144" and rows["widget-wide"] == "8.3K"
    assert "stdit-tiny" in rows  # the built-ins are still there
    info = _ok(_run([sys.executable, "-m", "dspzoo", "info", "Widget-Wide"], env=env))
    assert info.splitlines()[0] == "widget-wide: 8.3K parameters"
    assert "width                  64" in info
    built = _ok(
        _python(
            """
            from dspzoo.zoo import count_parameters, create_model
            print(count_parameters(create_model("widget-mini", depth=3)))
            """,
            env=env,
        )
    )
    assert built.strip() == str(3 * (8 * 8 + 8))


def test_dspzoo_families_variable_registers_a_scripts_module(tmp_path: Path) -> None:
    (tmp_path / "my_widget.py").write_text(PLUGIN.format(family="scriptwidget"))
    env = {"PYTHONPATH": str(tmp_path), "DSPZOO_FAMILIES": " my_widget ,"}
    out = _ok(
        _python(
            """
            from dspzoo.zoo import create_model, list_models
            from dspzoo.zoo.cli import main
            print(type(create_model("scriptwidget-mini")).__name__)
            main(["info", "scriptwidget-wide"])
            print("stdit-tiny" in list_models())
            """,
            env=env,
        )
    )
    assert out.splitlines() == [
        "Widget",
        "scriptwidget-wide: 8.3K parameters",
        "  width                  64",
        "  depth                  2",
        "True",
    ]
    saved = tmp_path / "saved"
    _ok(
        _python(
            f"""
            from dspzoo.zoo import create_model, save_pretrained
            save_pretrained(create_model("scriptwidget-wide", depth=1), {str(saved)!r})
            """,
            env=env,
        )
    )
    loaded = _python(  # a fresh process: the checkpoint's family is found through the variable
        f"""
        from dspzoo.zoo import from_pretrained
        print(from_pretrained({str(saved)!r}).config)
        """,
        env=env,
    )
    assert _ok(loaded).strip() == "WidgetConfig(width=64, depth=1)"


def test_unknown_family_says_how_to_register_and_a_broken_plugin_is_named(
    tmp_path: Path,
) -> None:
    env = {"DSPZOO_FAMILIES": "no_such_widgets"}
    proc = _python(
        """
        from dspzoo.zoo import create_model, list_models
        print(type(create_model("stdit-tiny")).__name__)  # built-ins load despite the plugin
        try:
            list_models()
        except ImportError as exc:
            print(exc)
        """,
        env=env,
    )
    lines = _ok(proc).splitlines()
    assert lines[0] == "STDiT"
    assert "cannot import module 'no_such_widgets', named by DSPZOO_FAMILIES=" in lines[1]
    assert "ModuleNotFoundError" in lines[1]
    proc = _run([sys.executable, "-m", "dspzoo", "info", "widgit-mini"])
    assert proc.returncode == 2
    assert "unknown model family 'widgit'" in proc.stderr
    assert "'dspzoo.families' entry point" in proc.stderr and "DSPZOO_FAMILIES=" in proc.stderr
    assert "import the domain" not in proc.stderr and "load_domains" not in proc.stderr


def test_a_plugin_that_reuses_a_builtin_name_is_refused(tmp_path: Path) -> None:
    (tmp_path / "clash.py").write_text(PLUGIN.format(family="Toy2D"))  # names ignore case
    proc = _python(
        "from dspzoo.zoo import list_models\nlist_models()\n",
        env={"PYTHONPATH": str(tmp_path), "DSPZOO_FAMILIES": "clash"},
    )
    assert proc.returncode != 0
    assert (
        "model family 'Toy2D' is already registered (as 'toy2d'; names ignore case), by dspzoo's "
        "built-in module 'dspzoo.domains.toy'; module 'clash' (named by DSPZOO_FAMILIES='clash') "
        "registers it again. A built-in family keeps its name: give yours another one, or take "
        "'clash' out of DSPZOO_FAMILIES"
    ) in proc.stderr


def test_a_family_registered_twice_names_both_sources_and_the_fix(tmp_path: Path) -> None:
    """An installed entry point and ``DSPZOO_FAMILIES`` registering the same family: every
    ``dspzoo list``/``info`` fails with one line naming who registered it first, who again, and
    how to keep one of the two (it used to say only "already registered")."""
    _installed_plugin(tmp_path, "widget")
    (tmp_path / "my_widget.py").write_text(PLUGIN.format(family="widget"))
    env = {"PYTHONPATH": str(tmp_path), "DSPZOO_FAMILIES": "my_widget"}
    expected = (
        "error: model family 'widget' is already registered, by module 'widgets_pkg.zoo' "
        "(named by the 'dspzoo.families' entry point 'widgets' of the installed package "
        "widgets-pkg 0.3); module 'my_widget' (named by DSPZOO_FAMILIES='my_widget') registers "
        "it again. Keep one of the two: remove the 'dspzoo.families' entry point naming "
        "'widgets_pkg.zoo' (or uninstall its package), or take 'my_widget' out of DSPZOO_FAMILIES"
    )
    for command in (["list"], ["info", "widget-mini"]):
        proc = _run([sys.executable, "-m", "dspzoo", *command], env=env)
        name = f"dspzoo {command[0]}"  # the CLI's one-line usage error, naming the command
        line = f"{name}: {expected} (see {name} --help)"
        assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stderr
    imported = _python(  # a script's own import first: named as the module it is
        """
        import my_widget
        from dspzoo.zoo import list_models
        try:
            list_models()
        except ImportError as exc:
            print(exc)
        """,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert _ok(imported).strip() == (
        "model family 'widget' is already registered, by module 'my_widget'; module "
        "'widgets_pkg.zoo' (named by the 'dspzoo.families' entry point 'widgets' of the installed "
        "package widgets-pkg 0.3) registers it again. Keep one of the two: stop importing "
        "'my_widget' (or its register_family call), or remove the 'dspzoo.families' entry point "
        "naming 'widgets_pkg.zoo' (or uninstall its package)"
    )


def test_the_docs_example_module_runs_as_the_guide_says() -> None:
    """docs/new_architecture.md: ``PYTHONPATH=examples/my_widget DSPZOO_FAMILIES=my_widget
    dspzoo list|info|plan`` and ``create_model``, from the repository's root."""
    root = Path(__file__).resolve().parents[1]
    assert (root / "examples" / "my_widget" / "my_widget.py").is_file()
    env = {**os.environ, "PYTHONPATH": "examples/my_widget", "DSPZOO_FAMILIES": "my_widget"}

    def run(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=root, env=env
        )
        return _ok(proc)

    rows = dict(line.split() for line in run("-m", "dspzoo", "list").splitlines())
    assert rows["widget-mini"] == "144" and rows["widget-wide"] == "8.3K" and "stdit-tiny" in rows
    info = run("-m", "dspzoo", "info", "widget-mini").splitlines()
    assert info == [
        "widget-mini: 144 parameters",
        "  width                  8",
        "  depth                  2",
    ]
    plan = run("-m", "dspzoo", "plan", "widget-mini", "--dims", "h=64,w=64", "--sp", "1,2")
    assert plan.startswith("widget-mini: 144 parameters, batch 1, tokens (h=64, w=64)")
    assert "  SP 2: every stage local (each mixes a dim that is whole)" in plan
    # no TP_PLAN: megatron_sp's row is "not runnable", and so is its methods line
    assert "  SP 2: not runnable (the table's row says why)  (megatron_sp)" in plan
    assert "every stage megatron_sp" not in plan
    built = run("-c", "from dspzoo.zoo import create_model; print(create_model('widget-mini'))")
    assert built.startswith("Widget(") and built.count("Linear(in_features=8, out_features=8") == 2
