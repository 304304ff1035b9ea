import logging

__version__ = "0.1.0"

# Progress, checkpoint and upload lines are INFO: part of what a run reports. Handlers are the
# application's (Prefect's extra loggers, the Ray Job driver's basicConfig); without one,
# nothing is printed.
logging.getLogger(__name__).setLevel(logging.INFO)
