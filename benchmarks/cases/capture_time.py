"""placeholder"""
NAME = "capture_time"
TITLE = "capture_time"


def run(settings):
    return []
