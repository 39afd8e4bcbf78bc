"""Executors run the workers: in process (`uniproc`), one process per rank on this machine
(`multiproc`) or Ray actors (`ray`); `abstract.get_executor_class` picks one by backend name."""
