"""JupyterHub for a workshop room on one machine (one GPU node shared by many learners).

    sudo jupyterhub -f docs/jupyterhub/jupyterhub_config.py        # from the course's environment

Every learner gets a JupyterLab with the course's settings (jupyter/: no news pop-up, no nbgrader), their
own copy of labs/ in work/ (solutions/ is a read-only link to the shared checkout), and their own build folder,
caches and results (COURSE_BUILD_DIR and the caches under ~/rocm-cuda-labs/build): nothing of one learner
is written where another's goes, and the shared checkout is only read. Ports: every server gets a free
one from the spawner, lab 05's server a free one of its own. GPUs: with COURSE_HUB_GPUS="0,1,2,3" each
learner sees one of them (spread by name); the labs size their work from *free* GPU memory
(utils.params.available_memory_bytes), so learners sharing a GPU shrink to fit.

COURSE_HUB_MODE picks how people log in:
- "room" (default): real accounts. PAM (the machine's Unix users: `sudo adduser learner01`, or use
  `c.JupyterHub.authenticator_class = "github"` / "generic-oauth" from the oauthenticator package with
  your institution's login) and LocalProcessSpawner (each server runs as its learner's Unix user).
  HTTPS: put the certificate and key in COURSE_HUB_SSL_CERT / COURSE_HUB_SSL_KEY (Let's Encrypt:
  `certbot certonly --standalone -d hub.example.org`); the hub listens on 0.0.0.0:443. Behind a
  reverse proxy that terminates TLS, leave them unset and set COURSE_HUB_BIND (e.g. http://127.0.0.1:8000).
  Admins: COURSE_HUB_ADMINS="alice,bob" (they keep nbgrader's formgrader through their own Jupyter config).
- "test": no accounts (a dummy authenticator, SimpleLocalProcessSpawner with homes under COURSE_HUB_HOMES),
  127.0.0.1 only; tests/test_workshop_hub.py uses it. Never on a network.

Other variables: COURSE_HUB_CHECKOUT (the shared checkout; default: the one holding this file),
COURSE_HUB_PORT (test mode: the hub's public port), COURSE_HUB_LEARNER_PYTHON (the Python that prepares a
learner's folder as the learner; default: the hub's), COURSE_HUB_STATE (database, cookie secret; default:
the working directory), COURSE_HUB_THREADS (OMP_NUM_THREADS per learner; default: cores / 4, at least 1).
"""
import os
import pwd
import subprocess
import sys
import zlib
from pathlib import Path

c = get_config()  # noqa: F821 (defined by JupyterHub when it loads this file)

CHECKOUT = Path(os.environ.get("COURSE_HUB_CHECKOUT") or Path(__file__).resolve().parents[2]).resolve()
MODE = os.environ.get("COURSE_HUB_MODE", "room")
STATE = Path(os.environ.get("COURSE_HUB_STATE") or os.getcwd()).resolve()
WORK = "rocm-cuda-labs"          # each learner's folder, in their home
BIN = Path(sys.executable).parent  # the course's environment (jupyterhub-singleuser, the kernel)
# the Python that prepares a learner's folder as the learner (only the standard library is needed); it and the
# checkout must be readable by the learners, as the course's environment is on a hub
LEARNER_PYTHON = os.environ.get("COURSE_HUB_LEARNER_PYTHON") or sys.executable
sys.path.insert(0, str(CHECKOUT))
from utils.base.paths import run_environment  # noqa: E402 (the course's run environment: course.env)
from utils.machinery import workspace  # noqa: E402 (a learner's folder, made as the learner)

if MODE not in ("room", "test"):
    raise ValueError(f"COURSE_HUB_MODE={MODE!r}: use 'room' or 'test'")

c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")
c.JupyterHub.cleanup_servers = True      # stopping the hub stops every learner's server
c.JupyterHub.cleanup_proxy = True
c.Spawner.cmd = [str(BIN / "jupyterhub-singleuser")]
c.Spawner.notebook_dir = f"~/{WORK}"
c.Spawner.default_url = "/lab/tree/work/00_environment.ipynb"
c.Spawner.start_timeout = 180            # a room starting at once, on a busy machine
c.Spawner.http_timeout = 180


def home(spawner) -> Path:
    if getattr(spawner, "home_dir", None):          # SimpleLocalProcessSpawner (test mode)
        return Path(spawner.home_dir)
    return Path(pwd.getpwnam(spawner.user.name).pw_dir)


def work(spawner) -> Path:
    return home(spawner) / WORK


def gpu_for(spawner) -> str | None:
    gpus = [g.strip() for g in os.environ.get("COURSE_HUB_GPUS", "").split(",") if g.strip()]
    return gpus[zlib.crc32(spawner.user.name.encode()) % len(gpus)] if gpus else None


def environment(spawner) -> dict:
    """The learner's environment: the shared code, the course's Jupyter settings, everything written
    under the learner's own build folder."""
    build = work(spawner) / "build"
    env = {
        **run_environment(build, keep_existing=False),   # course.env under the learner's build folder
        "PYTHONPATH": str(CHECKOUT),
        "JUPYTER_CONFIG_PATH": str(CHECKOUT / "jupyter"),
        "OMP_NUM_THREADS": os.environ.get("COURSE_HUB_THREADS") or str(max(1, (os.cpu_count() or 4) // 4)),
    }
    for name in ("COURSE_DEVICE", "COURSE_VLLM_PYTHON", "COURSE_REQUIRE_TOOLS"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    gpu = gpu_for(spawner)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = env["HIP_VISIBLE_DEVICES"] = gpu
    return env


def prepare(spawner):
    """Before a learner's server starts: their own copy of labs/ in work/ (kept across restarts: it holds their
    work), solutions/ as a link to the shared checkout, and their private build folder. In a room the hub
    runs as root, so the folder is made by a process running as the learner (utils/machinery/workspace.py):
    root never creates, follows or changes the owner of anything in a learner's home (docs/jupyterhub/README.md)."""
    folder = work(spawner)
    if MODE == "room":
        user = pwd.getpwnam(spawner.user.name)
        run = subprocess.run([LEARNER_PYTHON, "-m", "utils.machinery.workspace", str(folder), "--checkout", str(CHECKOUT)],
                             user=user.pw_uid, group=user.pw_gid, extra_groups=[], cwd=user.pw_dir,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(CHECKOUT), "HOME": user.pw_dir},
                             capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            raise RuntimeError(f"{spawner.user.name}'s folder {folder} could not be prepared: "
                               f"{(run.stderr.strip().splitlines() or ['(no message)'])[-1]}")
    else:
        workspace.prepare(folder, CHECKOUT)   # test mode: every server runs as the hub's own user
    spawner.environment = {**spawner.environment, **environment(spawner)}


c.Spawner.pre_spawn_hook = prepare

if MODE == "test":
    c.JupyterHub.authenticator_class = "dummy"
    c.JupyterHub.spawner_class = "simple"
    c.SimpleLocalProcessSpawner.home_dir_template = str(Path(os.environ["COURSE_HUB_HOMES"]) / "{username}")
    c.JupyterHub.bind_url = f"http://127.0.0.1:{os.environ.get('COURSE_HUB_PORT', '8000')}"
    c.JupyterHub.hub_ip = "127.0.0.1"
    c.JupyterHub.hub_port = int(os.environ.get("COURSE_HUB_API_PORT", "8081"))
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{os.environ.get('COURSE_HUB_PROXY_PORT', '8001')}"
    c.Spawner.ip = "127.0.0.1"
    if os.geteuid() == 0:   # a test in a container runs as root: every learner's server does too
        c.Spawner.args = ["--allow-root"]
    c.Authenticator.allow_all = True
else:
    c.JupyterHub.authenticator_class = "pam"
    c.JupyterHub.spawner_class = "localprocess"
    c.Authenticator.allow_existing_users = True
    c.Authenticator.admin_users = {u for u in os.environ.get("COURSE_HUB_ADMINS", "").split(",") if u}
    cert, key = os.environ.get("COURSE_HUB_SSL_CERT"), os.environ.get("COURSE_HUB_SSL_KEY")
    if cert and key:
        c.JupyterHub.bind_url = "https://0.0.0.0:443"
        c.JupyterHub.ssl_cert, c.JupyterHub.ssl_key = cert, key
    else:
        c.JupyterHub.bind_url = os.environ.get("COURSE_HUB_BIND", "http://127.0.0.1:8000")
