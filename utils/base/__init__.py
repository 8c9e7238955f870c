"""The floor everything else stands on: where files go and may be written (paths), files written and read
back safely (state), processes the course starts and never leaves behind (processes). Imports nothing else
of the course."""
