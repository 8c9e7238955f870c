# The course's JupyterLab settings for learners (make lab, Binder, JupyterHub): this folder is put on
# JUPYTER_CONFIG_PATH. It switches off JupyterLab's news and update pop-ups (lab/settings/overrides.json)
# and hides nbgrader from learners (labconfig/page_config.json, jupyter_server_config.json); instructors
# start JupyterLab without this folder on the path (docs/instructor.md).
from pathlib import Path

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)
c.LabApp.app_settings_dir = str(Path(__file__).resolve().parent / "lab" / "settings")
