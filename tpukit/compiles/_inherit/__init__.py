"""The folder tpukit puts on the ``PYTHONPATH`` of the processes a traced process starts: its
``sitecustomize`` drops an inherited compile trace (see that module). Not imported by tpukit."""
