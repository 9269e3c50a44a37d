"""``mesh service install|uninstall``: start the node at login.

macOS gets a launchd agent (``~/Library/LaunchAgents/dev.mlx-mesh.node.plist``), Linux a systemd
user unit (``~/.config/systemd/user/mlx-mesh.service``); both run ``mesh up``. Rendering is pure
(:func:`render_launchd_plist`, :func:`render_systemd_unit`); the commands write the file and, when
the service manager is present, register it. ``--dry-run`` only prints the file.
"""

from __future__ import annotations

import plistlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from mesh.cli.app import HomeOption, app, console, err_console, fail, resolve_home

LAUNCHD_LABEL = "dev.mlx-mesh.node"
SYSTEMD_UNIT = "mlx-mesh.service"

service_app = typer.Typer(help="Run the node at login (launchd on macOS, systemd on Linux).")
app.add_typer(service_app, name="service")


@dataclass(frozen=True)
class ServicePlan:
    """Where the service file goes, what it says, and how to (un)register it."""

    platform: str  # "darwin" | "linux"
    path: Path
    content: str
    register: list[list[str]]
    unregister: list[list[str]]
    if_unregistered: str  # what a person should know when registering did not work


def mesh_executable() -> list[str]:
    """The command that runs ``mesh``: the script next to this interpreter, else on PATH."""
    beside = Path(sys.executable).with_name("mesh")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("mesh")
    if found:
        return [str(Path(found).resolve())]
    return [sys.executable, "-c", "from mesh.cli import main; main()"]


def render_launchd_plist(command: list[str], home: Path, log_dir: Path) -> str:
    agent = {
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": command,
        "EnvironmentVariables": {"MLX_MESH_HOME": str(home)},
        "RunAtLoad": True,
        # Restart after a crash, not after a clean `mesh down`.
        "KeepAlive": {"SuccessfulExit": False},
        "ProcessType": "Interactive",
        "StandardOutPath": str(log_dir / "node.log"),
        "StandardErrorPath": str(log_dir / "node.log"),
    }
    return plistlib.dumps(agent, sort_keys=False).decode()


def _systemd_quote(arg: str) -> str:
    # systemd expands % specifiers and splits on whitespace; double quotes with escapes are safe.
    arg = arg.replace("%", "%%")
    if arg and not any(ch in arg for ch in " \t\"'\\;$"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_systemd_unit(command: list[str], home: Path) -> str:
    exec_start = " ".join(_systemd_quote(arg) for arg in command)
    return (
        "[Unit]\n"
        "Description=mlx-mesh node (worker + gateway + mesh)\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n"
        "\n"
        "[Service]\n"
        "Type=simple\n"
        f"Environment={_systemd_quote('MLX_MESH_HOME=' + str(home))}\n"
        f"ExecStart={exec_start}\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def make_plan(platform: str, user_home: Path, home: Path, up_args: list[str]) -> ServicePlan:
    command = [*mesh_executable(), "up", "--home", str(home), *up_args]
    if platform == "darwin":
        path = user_home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
        return ServicePlan(
            platform=platform,
            path=path,
            content=render_launchd_plist(command, home, home / "logs"),
            register=[["launchctl", "load", "-w", str(path)]],
            unregister=[["launchctl", "unload", "-w", str(path)]],
            if_unregistered="the agent is in place and launchd loads it at your next login",
        )
    if platform == "linux":
        path = user_home / ".config" / "systemd" / "user" / SYSTEMD_UNIT
        return ServicePlan(
            platform=platform,
            path=path,
            content=render_systemd_unit(command, home),
            register=[
                ["systemctl", "--user", "daemon-reload"],
                ["systemctl", "--user", "enable", SYSTEMD_UNIT],
            ],
            unregister=[
                ["systemctl", "--user", "disable", SYSTEMD_UNIT],
                ["systemctl", "--user", "daemon-reload"],
            ],
            if_unregistered=(
                "the unit is written but not enabled; run "
                f"`systemctl --user enable {SYSTEMD_UNIT}` from a login session"
            ),
        )
    raise fail(f"services are supported on macOS and Linux, not on {platform}")


def current_platform() -> str:
    return "linux" if sys.platform.startswith("linux") else sys.platform  # darwin stays darwin


def run_manager(commands: list[list[str]], consequence: str) -> bool:
    """Run the service manager's commands if it is installed; False (and a note ending in
    ``consequence``) if it is not or if it refuses (e.g. no user session bus in a container)."""
    for command in commands:
        if shutil.which(command[0]) is None:
            err_console.print(
                f"{command[0]} not found; {consequence}",
                style="yellow",
                soft_wrap=True,
            )
            return False
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            reason = (result.stderr or result.stdout).strip().splitlines()
            err_console.print(
                f"`{' '.join(command)}` failed ({reason[-1] if reason else result.returncode}); "
                f"{consequence}",
                style="yellow",
                markup=False,
                soft_wrap=True,
            )
            return False
    return True


_platform_option = typer.Option(
    None, "--platform", hidden=True, help="darwin or linux (default: this machine)."
)


@service_app.command(
    "install", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def install(
    ctx: typer.Context,
    home: Path | None = HomeOption,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the service file, change nothing."
    ),
    register: bool = typer.Option(
        True, "--register/--no-register", help="Also enable it with launchctl/systemctl."
    ),
    platform: str | None = _platform_option,
) -> None:
    """Install a login service that runs `mesh up` (extra arguments after -- go to `mesh up`)."""
    plan = make_plan(platform or current_platform(), Path.home(), resolve_home(home), ctx.args)
    if dry_run:
        err_console.print(f"# would write {plan.path}", style="dim", markup=False, highlight=False)
        console.print(plan.content, end="", markup=False, highlight=False, soft_wrap=True)
        return
    try:
        plan.path.parent.mkdir(parents=True, exist_ok=True)
        plan.path.write_text(plan.content)
        if plan.platform == "darwin":
            (resolve_home(home) / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise fail(f"cannot write {plan.path}: {exc.strerror or exc}") from None
    console.print(f"installed {plan.path}", markup=False, highlight=False)
    if register and run_manager(plan.register, plan.if_unregistered):
        console.print("the node will start at login; `mesh service uninstall` removes it")


@service_app.command("uninstall")
def uninstall(
    home: Path | None = HomeOption,
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be removed."),
    platform: str | None = _platform_option,
) -> None:
    """Remove the login service."""
    plan = make_plan(platform or current_platform(), Path.home(), resolve_home(home), [])
    if not plan.path.exists():
        console.print(f"no service installed ({plan.path} does not exist)", markup=False)
        return
    if dry_run:
        console.print(f"would remove {plan.path}", markup=False, highlight=False)
        return
    run_manager(plan.unregister, "removing the file anyway")
    try:
        plan.path.unlink()
    except OSError as exc:
        raise fail(f"cannot remove {plan.path}: {exc.strerror or exc}") from None
    console.print(f"removed {plan.path}", markup=False, highlight=False)
