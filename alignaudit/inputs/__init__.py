"""What a run is asked to do: the request, the checkpoint, the prompts, and the checks made before any engine starts."""
