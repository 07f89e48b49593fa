"""The device fingerprint asked of the CUDA driver (``convpass.core.device.detect``), on a stand-in
driver library: which device is current, what is read, and that any failure means no GPU."""

from __future__ import annotations

import sys
import threading
import types

import pytest

from convpass.native import device
from convpass.native.cudnn import library

DEVICES = [("NVIDIA H100 80GB HBM3", 9, 0, 132), ("NVIDIA H200", 9, 0, 132), ("NVIDIA L4", 8, 9, 58)]


class FakeDriver:
    """libcuda's calls that ``detect`` makes, answering for :data:`DEVICES`; ``current``: the
    device whose context is current on the calling thread (None: no context)."""

    def __init__(self, current: int | None = None, fail: str | None = None, count: int = len(DEVICES)) -> None:
        self.current, self.fail, self.count = current, fail, count
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        def call(*args):
            self.calls.append(name)
            if name == self.fail:
                return 999
            return getattr(self, "_" + name)(*args) or 0
        return call

    def _cuInit(self, flags):
        assert flags == 0

    def _cuDeviceGetCount(self, count):
        count._obj.value = self.count

    def _cuCtxGetCurrent(self, context):
        context._obj.value = None if self.current is None else 0x1000 + self.current

    def _cuCtxGetDevice(self, dev):
        dev._obj.value = self.current

    def _cuDeviceGet(self, dev, ordinal):
        dev._obj.value = ordinal

    def _cuDeviceGetName(self, buf, size, dev):
        assert size == len(buf)
        buf.value = DEVICES[dev.value][0].encode()

    def _cuDeviceGetAttribute(self, value, which, dev):
        name, major, minor, sms = DEVICES[dev.value]
        value._obj.value = {device._CC_MAJOR: major, device._CC_MINOR: minor, device._MULTIPROCESSOR_COUNT: sms}[which]


@pytest.fixture
def driver(monkeypatch):
    """Install a stand-in driver (returned; set its fields per test), CuPy present, cuDNN 9.19."""
    fake = FakeDriver()

    def cdll(name, *args, **kwargs):
        assert name == "libcuda.so.1"
        return fake

    monkeypatch.setattr(device.ctypes, "CDLL", cdll)
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: types.SimpleNamespace(name=name))
    monkeypatch.setattr(library, "version", lambda: 91900)
    return fake


def test_without_a_current_context_it_is_device_0(driver):
    assert str(device.detect()) == "NVIDIA H100 80GB HBM3|sm_9.0|132sm|cudnn91900"
    assert "cuCtxGetDevice" not in driver.calls


def test_the_device_of_the_current_context(driver):
    driver.current = 2
    assert device.detect() == device.DeviceFingerprint("NVIDIA L4", "8.9", 58, 91900)
    driver.current = 1
    assert device.detect().name == "NVIDIA H200"


@pytest.mark.parametrize("fail, current", [("cuInit", None), ("cuDeviceGetCount", None), ("cuCtxGetCurrent", None), ("cuDeviceGet", None),
                                           ("cuCtxGetDevice", 1), ("cuDeviceGetName", None), ("cuDeviceGetAttribute", 1)])
def test_a_failing_driver_call_means_no_gpu(driver, fail, current):
    driver.current = current
    driver.fail = fail
    assert device.detect() is None
    assert driver.calls[-1] == fail  # no GPU because of that call, not some other error


def test_no_device_means_no_gpu(driver):
    driver.count = 0
    assert device.detect() is None
    assert "cuDeviceGetName" not in driver.calls


def test_no_cudnn_means_no_gpu(driver, monkeypatch):
    def missing():
        raise OSError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(library, "version", missing)
    assert device.detect() is None


def test_without_cupy_the_driver_is_not_asked(driver, monkeypatch):
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert device.detect() is None
    assert driver.calls == []


def test_without_the_linux_driver_library_cupy_is_asked(driver, monkeypatch):
    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(device.ctypes, "CDLL", no_library)
    monkeypatch.setattr(device, "_asked_of_cupy", lambda: ("NVIDIA H200", "9.0", 132))
    assert str(device.detect()) == "NVIDIA H200|sm_9.0|132sm|cudnn91900"


def _driver_thread_done() -> None:
    for t in threading.enumerate():
        if t.name == "convpass-driver":
            t.join(10)


def test_the_driver_is_started_once_on_a_helper_thread(driver, monkeypatch):
    monkeypatch.setattr(device, "_driver_thread", None)
    loaded = []
    monkeypatch.setattr(library, "load", lambda: loaded.append(threading.current_thread().name))
    device.start_driver()
    device.start_driver()
    _driver_thread_done()
    assert driver.calls == ["cuInit"] and loaded == ["convpass-driver"]
    assert str(device.detect()) == "NVIDIA H100 80GB HBM3|sm_9.0|132sm|cudnn91900"  # the device is still chosen here


def test_a_driver_that_fails_to_start_is_left_to_detect(driver, monkeypatch):
    monkeypatch.setattr(device, "_driver_thread", None)
    driver.fail = "cuInit"
    device.start_driver()
    _driver_thread_done()
    assert device.detect() is None


def test_without_cupy_no_driver_is_started(driver, monkeypatch):
    monkeypatch.setattr(device, "_driver_thread", None)
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    device.start_driver()
    _driver_thread_done()
    assert driver.calls == []
