"""placeholder"""
NAME = "steady_state"
TITLE = "steady_state"


def run(settings):
    return []
