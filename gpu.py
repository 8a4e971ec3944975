"""The CUDA driver runtime on cuda-python (cuda.bindings.driver): the primary context of device 0, one
non-blocking stream, device buffers, PTX modules from kernels_ptx/, kernel launch, CUDA graphs, events.

Everything runs on the one stream `g.stream`, so work is ordered, except inside `with g.branch():`, whose
launches go to a second stream that runs beside the main one until `g.join()`; the host waits only in
`download`, `sync` and `elapsed_ms`. Every driver result goes through `check`. Buffers are freed explicitly
(`a.close()`, `g.free(a)`, or all at once by `g.close()`): a captured graph keeps raw pointers, so memory
must never vanish behind its back through garbage collection.

    g = GPU(); x = g.upload(np_array); f = g.module("elementwise").function("rmsnorm_bf16")
    g.launch(f, grid=(T, 1, 1), block=(256, 1, 1), args=[out, x, None, T, 2816, 1e-6])
    g.capture_begin(); ...launches...; graph = g.capture_end(); graph.replay(); y = g.download(out)

A Plan is the lighter replay: `plan = g.record_plan(body)` runs body's launches as they are and records the
driver calls they made (parameters copied); `g.replay_plan(plan)` makes those calls again, without body's host code
(step_plans.py: the prompt steps of a shape seen before).
"""
import contextlib
import ctypes
import math
import os
import struct
import threading
import time

import numpy as np

try:
    from cuda.bindings import driver as cu
except ImportError:                       # no cuda-python: available() says False, GPU() cannot be made
    cu = None
_SUCCESS = cu.CUresult.CUDA_SUCCESS if cu is not None else 0

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels_ptx")


class CudaError(RuntimeError):
    """A driver call failed: `name` is the CUresult name (CUDA_ERROR_...), `call` what was being done."""

    def __init__(self, name, call, detail=""):
        self.name, self.call = name, call
        super().__init__(f"{call}: {name}" + (f"\n{detail}" if detail else ""))


def check(result, call="cuda call"):
    """Unwrap a cuda-python result tuple (CUresult, *values): raise CudaError on failure, else return the one
    value, a tuple of several, or None."""
    err, vals = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != cu.CUresult.CUDA_SUCCESS:
        try:
            e, name = cu.cuGetErrorName(err)
            name = name.decode() if e == cu.CUresult.CUDA_SUCCESS else str(err)
        except Exception:                 # the name lookup itself failed: keep the raw code
            name = str(err)
        raise CudaError(name, call)
    return None if not vals else vals[0] if len(vals) == 1 else vals


def available():
    """True when cuda-python, the driver library and at least one device are present. Never raises."""
    if cu is None:
        return False
    try:
        check(cu.cuInit(0), "cuInit")
        return check(cu.cuDeviceGetCount(), "cuDeviceGetCount") > 0
    except Exception:                     # DynamicLibNotFoundError without libcuda, CudaError without a device
        return False


class i64(int):
    """A kernel argument passed as int64 (a plain python int goes as int32)."""


class ptr(int):
    """A raw device address passed as a pointer argument."""


class DeviceArray:
    """A device buffer: ptr (int address), shape, dtype, nbytes. A view (`GPU.view`) shares its base's memory
    and never frees it."""

    def __init__(self, gpu, ptr_, shape, dtype, nbytes, base=None):
        self.gpu, self.ptr, self.shape, self.dtype = gpu, ptr_, tuple(shape), np.dtype(dtype)
        self.nbytes, self.base = nbytes, base

    @property
    def size(self):
        return math.prod(self.shape)

    def close(self):
        if self.base is None and self.ptr:
            self.gpu.free(self)

    def __repr__(self):
        return f"DeviceArray(0x{self.ptr:x}, {self.shape}, {self.dtype}{', view' if self.base is not None else ''})"


class Function:
    """A kernel of a loaded module. `max_shared` remembers the dynamic shared-memory limit set so far: without an
    opt-in, static + dynamic shared memory must fit 48 KiB. `max_threads`: the largest CTA its registers allow."""

    def __init__(self, handle, name):
        attr = cu.CUfunction_attribute
        static = check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, handle),
                       f"cuFuncGetAttribute {name} SHARED_SIZE_BYTES")
        self.max_threads = int(check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, handle),
                                     f"cuFuncGetAttribute {name} MAX_THREADS_PER_BLOCK"))
        self.handle, self.name, self.max_shared = handle, name, 48 * 1024 - int(static)


class Module:
    def __init__(self, handle, name):
        self.handle, self.name, self._functions = handle, name, {}

    def function(self, name):
        if name not in self._functions:
            h = check(cu.cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction {self.name}.{name}")
            self._functions[name] = Function(h, f"{self.name}.{name}")
        return self._functions[name]


class Graph:
    """An instantiated CUDA graph. `launches`: kernels launched while it was captured."""

    def __init__(self, gpu, exec_, launches):
        self.gpu, self.exec, self.launches = gpu, exec_, launches

    def replay(self):
        check(cu.cuGraphLaunch(self.exec, self.gpu.stream), "cuGraphLaunch")

    def close(self):
        if self.exec is not None:
            check(cu.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            self.exec = None


class Event:
    def __init__(self, handle):
        self.handle = handle

    def close(self):
        if self.handle is not None:
            check(cu.cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


def _shape_bytes(shape, dtype):
    """(shape as a tuple of ints, its bytes in dtype): what empty, host_empty and view take as a shape."""
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(map(int, shape))
    return shape, math.prod(shape) * np.dtype(dtype).itemsize


def _arg(a):
    """One kernel argument as (value, code): "P" pointer (DeviceArray, ptr, None = null), "q" int64 (i64), "i" int32
    (int), "f" float32 (float). The exact types first: this runs for every argument of every launch."""
    t = type(a)
    if t is DeviceArray:
        return a.ptr, "P"
    if t is int and -2**31 <= a < 2**31:
        return a, "i"
    if t is float:
        return a, "f"
    if a is None:
        return 0, "P"                                  # a null pointer (e.g. no norm weight)
    if isinstance(a, ptr):
        return int(a), "P"
    if isinstance(a, i64):
        return int(a), "q"
    if isinstance(a, (float, np.floating)):
        return float(a), "f"
    if isinstance(a, (int, np.integer)):
        if not -2**31 <= int(a) < 2**31:
            raise OverflowError(f"kernel argument {int(a)} does not fit int32; pass gpu.i64(v)")
        return int(a), "i"
    raise TypeError(f"unsupported kernel argument type {type(a).__name__}")


# cuLaunchKernel's kernelParams in the void** form: a launch's values packed by one struct.pack_into into 8-byte
# slots, beside an array of the slots' addresses, both made once per argument layout (and thread) and reused,
# since the driver reads the values during the call. cuda-python's (values, types) form builds ctypes objects for
# every argument: with it a launch cost ~22 us of host time on the H200's host (BENCHMARKS.md, fourteenth
# session), and a 508-token prompt's ~400 eager launches took as long as its kernels.
_SLOT = {"P": "Q", "q": "q", "i": "i4x", "f": "f4x"}


class _Layouts(threading.local):
    def __init__(self):
        self.by_codes = {}                             # codes -> (struct, values buffer, slot addresses, address)
        self.by_types = {}                             # the arguments' types -> their codes' layout


_layouts = _Layouts()


def _layout(args):
    """The layout of args' codes (made on first use), remembered under their types: an argument's code follows
    from its type (_arg), so later launches with the same types skip _arg."""
    key = "".join(_arg(a)[1] for a in args)
    lay = _layouts.by_codes.get(key)
    if lay is None:
        n = max(len(key), 1)
        data = ctypes.create_string_buffer(8 * n)
        slots = (ctypes.c_void_p * n)(*[ctypes.addressof(data) + 8 * i for i in range(n)])
        lay = _layouts.by_codes[key] = (struct.Struct("<" + "".join(_SLOT[c] for c in key)), data, slots,
                                        ctypes.addressof(slots))
    _layouts.by_types[tuple(map(type, args))] = lay
    return lay


def _packed(args):
    """args' layout (_layout), their values packed into its buffer."""
    lay = _layouts.by_types.get(tuple(map(type, args))) or _layout(args)
    try:                                               # struct takes each value as _arg would give it
        lay[0].pack_into(lay[1], 0, *[a.ptr if type(a) is DeviceArray else 0 if a is None else a for a in args])
    except struct.error:
        for a in args:
            _arg(a)                                    # an int beyond int32 raises its own error here
        raise
    return lay


def kernel_params(args):
    """The void** kernelParams address of `args` (see _SLOT): valid until the next call with the same argument
    layout in this thread."""
    return _packed(args)[3]


class Plan:
    """The stream operations of a piece of host code, recorded by GPU.record_plan as the driver calls it made
    (kernel launches with their parameters copied, device copies and fills, event records and waits between the
    streams), to be made again, in the same order with the same arguments, by GPU.replay_plan: the same work on
    the GPU without the host code that decided it. `void` says why a recording cannot be replayed (it made a call
    that is not a stream operation: an allocation, a host copy, a wait on the GPU), None when it can."""

    def __init__(self):
        self.ops = []                   # (driver function, its arguments): a launch's kernelParams set by _finish
        self.launches, self.void = 0, None
        self.joined = True              # GPU._joined after the recording: a replay leaves it so
        self._values = []               # each launch's packed values (bytes), in launch order
        self._where = []                # each launch's (index in ops, index of kernelParams in its arguments)

    def launch(self, call, args, k, lay):
        """Record a launch: `call(*args)` with the kernelParams at args[k] (a list) made from what `lay`
        (gpu._layout) holds now: its values are copied here, given their address by _finish."""
        self._values.append(lay[1].raw[:lay[0].size])
        self._where.append((len(self.ops), k))
        self.ops.append((call, args))
        self.launches += 1

    def _finish(self):
        """Every launch's values in one buffer, their addresses (the void** arrays) in one array, each launch's
        kernelParams set to its own: one pass after the recording."""
        sizes = np.fromiter(map(len, self._values), np.int64, len(self._values))
        self._data = np.frombuffer(b"".join(self._values) or b"\0", np.uint8).copy()
        n = sizes // 8                                          # a launch's 8-byte slots
        first = np.concatenate([[0], np.cumsum(n)])             # its first slot's index among all
        starts = self._data.ctypes.data + np.concatenate([[0], np.cumsum(sizes)])[:-1]
        self._slots = np.zeros(max(int(first[-1]), 1), np.uint64)
        self._slots[:first[-1]] = np.repeat(starts, n) + 8 * (np.arange(first[-1]) - np.repeat(first[:-1], n))
        for (j, k), address in zip(self._where, (self._slots.ctypes.data + 8 * first[:-1]).tolist()):
            self.ops[j][1][k] = address
        self._values = self._where = None


class GPU:
    """The primary context of one device and one non-blocking stream; owns every buffer it allocates."""

    def __init__(self, device=0):
        check(cu.cuInit(0), "cuInit")
        self.device = check(cu.cuDeviceGet(device), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.bind()
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.name = check(cu.cuDeviceGetName(256, self.device), "cuDeviceGetName").split(b"\0")[0].decode()
        attr = cu.CUdevice_attribute
        self.capability = tuple(check(cu.cuDeviceGetAttribute(a, self.device), "cuDeviceGetAttribute") for a in (
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.sm_count = check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device),
                              "cuDeviceGetAttribute")
        self._modules = {}                 # name -> Module (cache)
        self.scratch = {}                  # name -> DeviceArray: buffers kernels' launchers share (layers.linear w16)
        self.w16_cache = {}                # FP8 weights' address -> their kept bf16 copy (layers.linear cache_w16)
        self._live = {}                    # ptr -> nbytes of every allocation not yet freed
        self._pinned = []                  # page-locked host allocations (host_empty), freed by close
        self._capture_launches = None      # kernel launches since capture_begin, None when not capturing
        self._plan = None                  # the Plan being recorded (record_plan), None when not recording
        self.launch_hook = None            # called after each launch (profiling), see launch()
        self.pdl = os.environ.get("SPAN02_PDL", "1") != "0"    # programmatic dependent launch where asked
        self._pdl_attr = cu.CUlaunchAttribute()
        self._pdl_attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self._pdl_attr.value.programmaticStreamSerializationAllowed = 1
        self._pdl_configs = {}             # (grid, block, shared, stream) -> CUlaunchConfig (launch)
        # branches: a second stream for work that may run beside the main stream's (see branch / join)
        self.branches = os.environ.get("SPAN02_BRANCHES", "1") != "0"
        self.main_stream = self.stream
        self.side_stream = None            # made by the first branch()
        self._fork_ev = self._join_ev = None
        self._joined = True                # no side work the main stream has not waited for
        self.wait_s = 0.0                  # host seconds blocked on the GPU so far (sync, wait, elapsed_ms, download)

    check = staticmethod(check)

    def bind(self):
        """Make this device's primary context current in the calling thread (once per thread that uses it)."""
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    @property
    def allocated_bytes(self):
        return sum(self._live.values())

    # --- memory ----------------------------------------------------------------------------------------
    def mem_free(self):
        """Bytes of device memory free now (cuMemGetInfo; other processes' allocations count as used)."""
        free, _total = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    def empty(self, shape, dtype):
        """An uninitialised buffer (poison it with fill(a, 0xFF) in tests)."""
        self._not_planned("an allocation")
        shape, nbytes = _shape_bytes(shape, dtype)
        p = int(check(cu.cuMemAlloc(max(nbytes, 1)), f"cuMemAlloc {nbytes} bytes"))
        self._live[p] = nbytes
        return DeviceArray(self, p, shape, dtype, nbytes)

    def host_empty(self, shape, dtype):
        """An uninitialised page-locked (pinned) host array, alive until close(). Copies from and into it are DMA'd
        as they stand, without the driver's staging of pageable memory, so an upload from it runs later: do not
        rewrite what it uploads before the copy has run (wait on an event recorded after it)."""
        self._not_planned("a host allocation")
        shape, nbytes = _shape_bytes(shape, dtype)
        p = int(check(cu.cuMemHostAlloc(max(nbytes, 1), 0), f"cuMemHostAlloc {nbytes} bytes"))
        self._pinned.append(p)
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(p)
        return np.frombuffer(raw, np.uint8, nbytes).view(dtype).reshape(shape)

    def free(self, a):
        self._not_planned("a free")
        if a.base is not None:
            raise ValueError("free of a view: free its base")
        copy = self.w16_cache.pop(a.ptr, None)             # FP8 weights' kept bf16 copy goes with them
        if copy is not None:
            self.free(copy)
        if a.ptr in self._live:
            check(cu.cuMemFree(a.ptr), "cuMemFree")
            del self._live[a.ptr]
        a.ptr = 0

    def view(self, a, offset_bytes, shape, dtype):
        """A sub-array of `a` starting offset_bytes in, contiguous; no copy, never frees."""
        shape, nbytes = _shape_bytes(shape, dtype)
        dtype = np.dtype(dtype)
        if offset_bytes < 0 or offset_bytes % dtype.itemsize or offset_bytes + nbytes > a.nbytes:
            raise ValueError(f"view [{offset_bytes}, +{nbytes}) {dtype} does not fit in {a}")
        return DeviceArray(self, a.ptr + offset_bytes, shape, dtype, nbytes, base=a if a.base is None else a.base)

    def upload(self, array, out=None):
        """Copy a host array to a new buffer, or into `out` (same nbytes). Asynchronous on the stream: the
        driver stages pageable memory before returning, so `array` may be dropped at once; a pinned one
        (host_empty) is read when the copy runs."""
        self._not_planned("an upload")
        array = np.ascontiguousarray(array)
        if out is None:
            out = self.empty(array.shape, array.dtype)
        elif out.nbytes != array.nbytes:
            raise ValueError(f"upload of {array.nbytes} bytes into {out} ({out.nbytes} bytes)")
        if array.nbytes:
            check(cu.cuMemcpyHtoDAsync(out.ptr, array.ctypes.data, array.nbytes, self.stream), "cuMemcpyHtoDAsync")
        return out

    def download(self, a, out=None):
        """Copy a buffer to a new host array (or into `out`) and wait for it."""
        out = np.empty(a.shape, a.dtype) if out is None else out
        if not out.flags.c_contiguous or out.nbytes != a.nbytes:
            raise ValueError(f"download of {a} into a host array of {out.nbytes} bytes")
        if a.nbytes:   # blocked: into pageable memory the driver returns once the stream has run up to the copy
            self._blocked(cu.cuMemcpyDtoHAsync, out.ctypes.data, a.ptr, a.nbytes, self.stream)
        self.sync()
        return out

    def copy(self, dst, src, nbytes=None):
        """Device-to-device copy on the stream (capturable)."""
        nbytes = src.nbytes if nbytes is None else nbytes
        if nbytes > min(src.nbytes, dst.nbytes):
            raise ValueError(f"copy of {nbytes} bytes from {src} to {dst}")
        self._stream_op(cu.cuMemcpyDtoDAsync, dst.ptr, src.ptr, nbytes, self.stream, what=f" {nbytes} bytes")

    def fill(self, a, byte):
        """Set every byte of `a` to `byte` (0xFF poisons bf16/f32 to NaN)."""
        self._stream_op(cu.cuMemsetD8Async, a.ptr, int(byte) & 0xFF, a.nbytes, self.stream)

    def sync(self):
        self.join()
        self._blocked(cu.cuStreamSynchronize, self.main_stream)

    def _blocked(self, call, *args):
        """A driver call that blocks the host until the GPU gets somewhere, its time added to wait_s: what a
        step's wall time less its wait_s leaves is the host's own part (GpuModel.gpu_wait_s, the engine's
        step_gpu_wait_ms)."""
        self._not_planned(f"a wait on the GPU ({call.__name__})")
        t0 = time.perf_counter()
        try:
            check(call(*args), call.__name__)
        finally:
            self.wait_s += time.perf_counter() - t0

    def _stream_op(self, call, *args, what=""):
        """A driver call that queues work on a stream (copy, fill, event record / wait): recorded into the plan.
        what: words for its error message after the call's name."""
        check(call(*args), f"{call.__name__}{what}")
        if self._plan is not None:
            self._plan.ops.append((call, args))

    def _not_planned(self, what):
        """A call that is no stream operation: a plan being recorded cannot replay it (Plan.void)."""
        if self._plan is not None and self._plan.void is None:
            self._plan.void = what

    # --- plans -----------------------------------------------------------------------------------------
    def record_plan(self, body):
        """Run body() as it is, recording its stream operations: the Plan (see Plan; check its `void`). The last
        branch is joined first, so that a replay starts from the state the recording started from."""
        if self._plan is not None or self._capture_launches is not None:
            raise RuntimeError("record_plan inside a recording or a capture")
        self.join()
        plan = self._plan = Plan()
        try:
            body()
        finally:
            self._plan = None
        plan.joined = self._joined
        if plan.void is None:
            plan._finish()
        return plan

    def replay_plan(self, plan):
        """Make a recorded plan's driver calls again, in order, with their recorded arguments (kernel parameters
        included): its work, queued as record_plan's body queued it, with no host code between the calls."""
        if plan.void is not None:
            raise RuntimeError(f"replay of a plan that made {plan.void}")
        self.join()
        for call, args in plan.ops:
            err = call(*args)
            if (err[0] if type(err) is tuple else err) != _SUCCESS:
                check(err, f"{call.__name__} (plan replay)")
        self._joined = plan.joined
        if self._capture_launches is not None:
            self._capture_launches += plan.launches

    # --- kernels ---------------------------------------------------------------------------------------
    def module(self, name):
        """kernels_ptx/<name>.ptx, JIT-compiled by the driver once and cached; the JIT log is in the error."""
        if name not in self._modules:
            with open(os.path.join(KERNELS, name + ".ptx"), "rb") as f:
                image = f.read() + b"\0"
            log = bytearray(16384)
            opts = [cu.CUjit_option.CU_JIT_ERROR_LOG_BUFFER, cu.CUjit_option.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES]
            err, handle = cu.cuModuleLoadDataEx(image, len(opts), opts, [log, len(log)])
            if err != cu.CUresult.CUDA_SUCCESS:
                try:
                    check((err,), f"cuModuleLoadDataEx {name}.ptx")
                except CudaError as e:
                    raise CudaError(e.name, e.call, bytes(log).split(b"\0")[0].decode(errors="replace")) from None
            self._modules[name] = Module(handle, name)
        return self._modules[name]

    def launch(self, f, grid, block, args, shared=0, nbytes=None, pdl=False, flops=None):
        """Launch kernel `f` on the stream. args: DeviceArray/ptr/None -> pointer, int -> int32,
        i64 -> int64, float -> float32. shared: dynamic shared memory bytes (opted in above 48 KiB).
        nbytes: the bytes the kernel must move (weights, KV), flops: its multiply-add work x 2 (matrix kernels), for
        profiles; `launch_hook(name, grid, block, nbytes, flops)`, when set, is called after each launch
        (model_gpu's profiles record an event there).
        pdl: programmatic dependent launch (sm_90): the kernel may start while the previous one finishes, so it
        MUST execute `griddepcontrol.wait` before it reads anything earlier kernels write and before its first
        global write (it may fetch weights before). With `self.pdl` False every launch is plain, and so is every
        launch on a branch (`branch()`), always: a branch's PDL grid becomes resident while the
        branch's kernel before it runs and holds its SMs' registers until then, which the main stream's kernels
        beside it need (H200, thirty-seventh session: with the dense MLP's branch plain the batch-1 decode step went
        2.437 -> 2.345 ms; BENCHMARKS.md)."""
        if shared > f.max_shared:
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(f.handle, attr, shared), f"cuFuncSetAttribute {f.name} shared={shared}")
            f.max_shared = shared
        lay = _packed(args)
        params = lay[3]
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        pdl = pdl and self.pdl and self.stream is self.main_stream
        if pdl:
            key = (grid, block, shared, id(self.stream))
            cfg = self._pdl_configs.get(key)
            if cfg is None:                                # made once per shape: ~10 us of host time each
                if len(self._pdl_configs) >= 4096:
                    self._pdl_configs.clear()
                cfg = cu.CUlaunchConfig()
                cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
                cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
                cfg.sharedMemBytes, cfg.hStream = shared, self.stream
                cfg.attrs, cfg.numAttrs = [self._pdl_attr], 1
                self._pdl_configs[key] = cfg
            err = cu.cuLaunchKernelEx(cfg, f.handle, params, 0)
        else:
            err = cu.cuLaunchKernel(f.handle, *grid, *block, shared, self.stream, params, 0)
        if (err[0] if type(err) is tuple else err) != _SUCCESS:
            check(err, f"{'cuLaunchKernelEx' if pdl else 'cuLaunchKernel'} {f.name} grid={grid} "
                       f"block={block} shared={shared}{' (PDL)' if pdl else ''}")
        if self._capture_launches is not None:
            self._capture_launches += 1
        if self._plan is not None:                         # the parameters copied, for the replay
            if pdl:
                self._plan.launch(cu.cuLaunchKernelEx, [cfg, f.handle, None, 0], 2, lay)
            else:
                self._plan.launch(cu.cuLaunchKernel, [f.handle, *grid, *block, shared, self.stream, None, 0], 9, lay)
        if self.launch_hook is not None:
            self.launch_hook(f.name, grid, block, nbytes, flops)

    # --- branches --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def branch(self):
        """The launches (and copies) inside go to a second stream that starts after everything the main stream
        has been given so far and runs beside what the main stream gets next, until `join()` makes the main
        stream wait for it. Captured into a graph, this is a fork and a join of the graph. The branch's work
        must not touch what the main stream's work between the fork and the join writes (the caller's
        contract). A branch still open when the next one starts is joined first. With SPAN02_BRANCHES=0
        (`self.branches` False) the launches simply stay on the main stream.
        The branch's own launches are plain (see launch); a PDL launch of the main stream right after the
        join gets a programmatic edge from the kernel(s) it depends on, in the other stream too: it waits
        (griddepcontrol.wait) for them like for its own stream's kernel."""
        if not self.branches:
            yield
            return
        if self.stream is not self.main_stream:
            raise RuntimeError("branch() inside a branch: one branch at a time")
        self.join()                        # one left open (an error between a branch and its join) waits first
        if self.side_stream is None:
            self.side_stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
            flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
            self._fork_ev, self._join_ev = (check(cu.cuEventCreate(flags), "cuEventCreate") for _ in range(2))
        self._stream_op(cu.cuEventRecord, self._fork_ev, self.main_stream, what=" (fork)")
        self._stream_op(cu.cuStreamWaitEvent, self.side_stream, self._fork_ev, 0, what=" (fork)")
        self.stream = self.side_stream
        try:
            yield
        finally:
            self.stream, self._joined = self.main_stream, False   # (a sync inside joined only what came before it)

    def join(self):
        """The main stream waits for the work of the last branch (a no-op when there is none to wait for)."""
        if self._joined:
            return
        self._stream_op(cu.cuEventRecord, self._join_ev, self.side_stream, what=" (join)")
        self._stream_op(cu.cuStreamWaitEvent, self.main_stream, self._join_ev, 0, what=" (join)")
        self._joined = True

    # --- graphs and events -----------------------------------------------------------------------------
    def capture_begin(self, global_mode=False):
        """Start recording the stream's work into a graph. Thread-local mode by default: other threads may keep
        using the driver (the HTTP thread never does); global mode forbids unsafe calls in every thread."""
        self._not_planned("a capture")
        mode = cu.CUstreamCaptureMode
        check(cu.cuStreamBeginCapture(self.stream, mode.CU_STREAM_CAPTURE_MODE_GLOBAL if global_mode
                                      else mode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        self._capture_launches = 0

    def capture_end(self):
        """Stop recording; returns the instantiated Graph (the template graph is destroyed)."""
        launches, self._capture_launches = self._capture_launches, None
        if not self._joined:               # our bug: the capture would fail with an unjoined fork
            self._joined = True
            cu.cuStreamEndCapture(self.stream)    # ends the (invalid) capture; its error is the one below
            raise RuntimeError("capture_end() with a branch not joined")
        graph = check(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        try:
            exec_ = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        finally:
            check(cu.cuGraphDestroy(graph), "cuGraphDestroy")
        return Graph(self, exec_, launches or 0)

    def capture(self, body, what):
        """body()'s work on the stream as an instantiated Graph, not run. A body that raises, or that allocates
        device memory while captured, is our bug: RuntimeError naming `what`, the stream out of capture mode."""
        before = self.allocated_bytes
        self.capture_begin()
        try:
            body()
        except Exception as e:
            try:                               # leave the stream out of capture mode
                self.capture_end().close()
            except Exception:
                pass
            raise RuntimeError(f"{what}: {e}") from e
        graph = self.capture_end()
        if self.allocated_bytes != before:
            graph.close()
            raise RuntimeError(f"{what}: the capture allocated device memory")
        return graph

    def event(self):
        return Event(check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DEFAULT), "cuEventCreate"))

    def record(self, ev, external=False):
        """Record ev on the stream. external: while capturing, as an event-record node of the graph (the event is
        then recorded at each replay, for timing); a plain record during capture only orders captured work."""
        if external:
            flag = cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL
            self._stream_op(cu.cuEventRecordWithFlags, ev.handle, self.stream, flag)
        else:
            self._stream_op(cu.cuEventRecord, ev.handle, self.stream)

    def wait(self, ev):
        """Block the host until the work before ev's last record has run (at once if it never was recorded)."""
        self._blocked(cu.cuEventSynchronize, ev.handle)

    def elapsed_ms(self, ev0, ev1):
        """Milliseconds between two recorded events (waits for the second)."""
        self._blocked(cu.cuEventSynchronize, ev1.handle)
        return check(cu.cuEventElapsedTime(ev0.handle, ev1.handle), "cuEventElapsedTime")

    def close(self):
        """Free every live buffer, unload the modules, release the stream and the primary context."""
        self.sync()
        for p in list(self._live):
            check(cu.cuMemFree(p), "cuMemFree")
        self._live.clear()
        for p in self._pinned:                 # arrays over them must not be touched after close
            check(cu.cuMemFreeHost(p), "cuMemFreeHost")
        self._pinned.clear()
        self.scratch.clear()
        self.w16_cache.clear()
        for m in self._modules.values():
            check(cu.cuModuleUnload(m.handle), "cuModuleUnload")
        self._modules.clear()
        if self.side_stream is not None:
            for ev in (self._fork_ev, self._join_ev):
                check(cu.cuEventDestroy(ev), "cuEventDestroy")
            check(cu.cuStreamDestroy(self.side_stream), "cuStreamDestroy")
        check(cu.cuStreamDestroy(self.main_stream), "cuStreamDestroy")
        check(cu.cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease")
