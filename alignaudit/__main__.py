from alignaudit.commands.cli import entrypoint

entrypoint()
