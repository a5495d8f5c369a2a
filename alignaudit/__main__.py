from alignaudit.cli import entrypoint

entrypoint()
