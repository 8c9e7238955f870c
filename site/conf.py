"""Sphinx configuration of the course website (`make site`; utils/machinery/site.py stages this folder with the
lab pages and the report, then builds it). Nothing is executed and nothing is fetched: the notebooks are shown with
the outputs they carry, the theme's files are all in its PyPI wheel, and no page loads a script or style off-site."""
import os

# The GitHub repository and branch that Binder launches and commit links point to (make site SITE_REPO=owner/name).
REPO = os.environ.get("COURSE_SITE_REPO", "rocm-cuda-labs/rocm-cuda-labs")
BRANCH = os.environ.get("COURSE_SITE_BRANCH", "main")

project = "rocm-cuda-labs"
author = "rocm-cuda-labs"
copyright = "rocm-cuda-labs (MIT licence)"

extensions = ["myst_nb", "sphinx.ext.extlinks"]
exclude_patterns = ["labs/downloads", "_include", ".doctrees", "**/.ipynb_checkpoints"]
# The build is strict (-W: a missing image, page or reference fails it); only cosmetic warnings are let pass: a heading
# that skips a level, a code language with no highlighter, an output type a web page cannot show.
suppress_warnings = ["myst.header", "mystnb.lexer", "mystnb.mime_type", "misc.highlighting_failure"]

# The executed copies are shown as they are: never re-executed at build time.
nb_execution_mode = "off"
nb_ipywidgets_js = {}                       # the default loads require.js and the widget manager from CDNs
nb_merge_streams = True
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# {tree}`docker/`, {blob}`README.md`, {commit}`<sha>`, {binder}`launch <lab/tree/work/00_environment.ipynb>`
extlinks = {
    "tree": (f"https://github.com/{REPO}/tree/{BRANCH}/%s", "%s"),
    "blob": (f"https://github.com/{REPO}/blob/{BRANCH}/%s", "%s"),
    "commit": (f"https://github.com/{REPO}/commit/%s", "%s"),
    "binder": (f"https://mybinder.org/v2/gh/{REPO}/{BRANCH}?urlpath=%s", None),
}

html_theme = "furo"                         # system fonts, its CSS and JS in the wheel: no web fonts, no CDN
html_title = "rocm-cuda-labs"
html_static_path = ["_static"]
html_favicon = "_static/favicon.svg"      # else browsers ask the server for /favicon.ico
html_last_updated_fmt = None
html_copy_source = False
html_show_sourcelink = False
