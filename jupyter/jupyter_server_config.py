# The course's JupyterLab settings for learners (make lab, Binder, JupyterHub): this folder is put on
# JUPYTER_CONFIG_PATH. It switches off JupyterLab's news and update pop-ups (lab/settings/overrides.json)
# and hides nbgrader from learners (labconfig/page_config.json, jupyter_server_config.json); instructors
# start JupyterLab without this folder on the path (docs/instructor.md).
from pathlib import Path

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)
c.LabApp.app_settings_dir = str(Path(__file__).resolve().parent / "lab" / "settings")


# JupyterLab marks a notebook as changed (the dot on its tab) as soon as its kernel reports a
# language_info that differs from the notebook's, and the Python version differs from machine to machine
# (the notebooks record the course's own). This contents manager hands a Python notebook to the browser with
# language_info as ipykernel in this environment reports it (this Python's version; fields a notebook lacks
# filled in); the file on disk is untouched until the learner saves.
import platform  # noqa: E402

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager  # noqa: E402

IPYKERNEL_LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                           "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                           "pygments_lexer": "ipython3"}


class CourseContentsManager(AsyncLargeFileManager):
    async def get(self, path, content=True, type=None, format=None, **kwargs):
        model = await super().get(path, content=content, type=type, format=format, **kwargs)
        if content and model.get("type") == "notebook" and isinstance(model.get("content"), dict):
            meta = model["content"].get("metadata", {})
            info = meta.get("language_info")
            if isinstance(info, dict) and info.get("name") == "python" and \
                    meta.get("kernelspec", {}).get("name") == "python3":
                for key, value in IPYKERNEL_LANGUAGE_INFO.items():
                    info.setdefault(key, value)
                info["version"] = platform.python_version()
        return model


c.ServerApp.contents_manager_class = CourseContentsManager


# Kernels talk to the server over CurveZMQ-encrypted TCP (keys the server provisions; "auto" keeps plain TCP for a
# kernelspec that cannot take them): a second local user on a workshop machine cannot read a learner's code and
# outputs off the loopback ports, and ipykernel has no "running over TCP without encryption" warning to print.
import zmq  # noqa: E402

if zmq.has("curve"):
    c.MappingKernelManager.transport_encryption = "auto"

# jupyter_server keeps its websockets alive itself, with an interval and a timeout in milliseconds (30 s, 90 s); tornado
# reads the same two figures as seconds, finds the timeout longer than the interval and warns on every `make lab`
# ("The websocket_ping_timeout (90000) cannot be longer than ..."). Nothing is wrong (tornado then pings every 30000 s,
# and jupyter_server's own keep-alive works), and making the two equal closes busy kernels' websockets: drop the line.
import logging  # noqa: E402


class _TornadoPingUnits(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "websocket_ping_timeout" not in record.getMessage()


logging.getLogger("tornado.general").addFilter(_TornadoPingUnits())
