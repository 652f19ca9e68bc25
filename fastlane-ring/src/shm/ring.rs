//! [`ShmRing`]: creating, opening and validating the mapping, before either side attaches.

use super::*;

/// A mapped shared-memory ring, not yet attached as either side.
///
/// Attach with [`producer`](ShmRing::producer) or [`consumer`](ShmRing::consumer); the handles
/// keep the mapping alive, so the `ShmRing` may be dropped after attaching.
#[derive(Debug)]
pub struct ShmRing {
    pub(super) shared: Arc<Shared>,
}

impl ShmRing {
    /// Creates a ring of `capacity` data bytes in a new memfd named `name` (the name is only
    /// for `/proc/<pid>/fd`). The memfd is sealed against shrinking and growing, is
    /// close-on-exec, and is passed to the peer with [`as_fd`](AsFd::as_fd) (clear `FD_CLOEXEC`
    /// on a duplicate, or send it over a Unix socket) and opened there with
    /// [`from_fd`](ShmRing::from_fd).
    pub fn create_memfd(name: &str, capacity: usize) -> Result<ShmRing, ShmError> {
        let capacity = check_capacity(capacity as u64)?;
        let file = sealed_memfd(name, layout::DATA_OFFSET as u64 + capacity)?;
        Self::init(file, capacity)
    }

    /// Creates a ring of `capacity` data bytes in a new file at `path` (normally under
    /// `/dev/shm`). Fails if `path` exists. The file appears at `path` only once its header is
    /// complete (it is written under a temporary name and linked into place). The caller owns
    /// the path: the ring does not remove it.
    ///
    /// A peer that can write the file can also truncate it, which makes the next access
    /// `SIGBUS`; use [`create_memfd`](ShmRing::create_memfd) for peers that are not trusted.
    pub fn create_file(path: impl AsRef<Path>, capacity: usize) -> Result<ShmRing, ShmError> {
        let path = path.as_ref();
        let capacity = check_capacity(capacity as u64)?;
        static CREATED: AtomicU32 = AtomicU32::new(0);
        let mut tmp_name = path.as_os_str().to_owned();
        let n = CREATED.fetch_add(1, Ordering::Relaxed);
        tmp_name.push(format!(".tmp-{}-{n}", std::process::id()));
        let tmp = PathBuf::from(tmp_name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io_err("create"))?;
        let result = file
            .set_len(layout::DATA_OFFSET as u64 + capacity)
            .map_err(io_err("ftruncate"))
            .and_then(|()| Self::init(file, capacity))
            .and_then(|ring| std::fs::hard_link(&tmp, path).map(|()| ring).map_err(io_err("link")));
        let _ = std::fs::remove_file(&tmp);
        result
    }

    /// Opens the ring in the file at `path`, validating its header.
    pub fn open_file(path: impl AsRef<Path>) -> Result<ShmRing, ShmError> {
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(io_err("open"))?;
        Self::open(file, false)
    }

    /// Opens the ring in `fd`, normally a memfd from [`create_memfd`](ShmRing::create_memfd)
    /// in another process. A memfd that is not sealed against shrinking gets the seal now; an
    /// fd that lacks it and cannot take it (a memfd created without `MFD_ALLOW_SEALING`, or a
    /// file rather than a memfd) is refused with [`ShmError::Unsealed`]: open files by path
    /// with [`open_file`](ShmRing::open_file).
    pub fn from_fd(fd: OwnedFd) -> Result<ShmRing, ShmError> {
        Self::open(File::from(fd), true)
    }

    /// Capacity of the data area in bytes.
    pub fn capacity(&self) -> usize {
        self.shared.capacity as usize
    }

    /// Attaches as the producer, claiming the role (see the module docs).
    pub fn producer(&self) -> Result<Producer, ShmError> {
        self.shared.claim(Role::Producer)?;
        Producer::attach(Arc::clone(&self.shared)).inspect_err(|_| {
            self.shared.unclaim(Role::Producer);
        })
    }

    /// Attaches as the consumer, claiming the role (see the module docs).
    pub fn consumer(&self) -> Result<Consumer, ShmError> {
        self.shared.claim(Role::Consumer)?;
        Consumer::attach(Arc::clone(&self.shared)).inspect_err(|_| {
            self.shared.unclaim(Role::Consumer);
        })
    }

    /// Writes a fresh header into a zero-filled file of the right length and maps it.
    fn init(file: File, capacity: u64) -> Result<ShmRing, ShmError> {
        let shared = map(file, capacity)?;
        let h = shared.header();
        h.version.store(layout::ABI_VERSION, Ordering::Relaxed);
        h.flags.store(0, Ordering::Relaxed);
        h.capacity.store(capacity, Ordering::Relaxed);
        h.data_offset.store(layout::DATA_OFFSET as u64, Ordering::Relaxed);
        h.creator_pid.store(std::process::id(), Ordering::Relaxed);
        // Pairs with the opener's read of the magic: a ring with the magic is initialised.
        // (Openers read the header with `pread`, after the file became visible to them through
        // a syscall; the store is `Release` for openers of an already-mapped memfd.)
        h.magic.store(layout::MAGIC, Ordering::Release);
        Ok(ShmRing { shared: Arc::new(shared) })
    }

    /// Validates the header of an existing ring file and maps it.
    fn open(file: File, seal: bool) -> Result<ShmRing, ShmError> {
        if seal {
            ensure_shrink_seal(&file)?;
        }
        let len = file.metadata().map_err(io_err("fstat"))?.len();
        if len < layout::HEADER_LEN as u64 {
            return Err(ShmError::Truncated { len, needed: layout::HEADER_LEN as u64 });
        }
        let mut raw = [0u8; layout::HEADER_LEN];
        file.read_exact_at(&mut raw, 0).map_err(io_err("read header"))?;
        let u64_at = |off: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[off..off + 8]);
            u64::from_ne_bytes(b)
        };
        let u32_at = |off: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&raw[off..off + 4]);
            u32::from_ne_bytes(b)
        };
        let magic = u64_at(layout::OFF_MAGIC);
        if magic != layout::MAGIC {
            return Err(ShmError::BadMagic { found: magic });
        }
        let version = u32_at(layout::OFF_VERSION);
        if version != layout::ABI_VERSION {
            return Err(ShmError::BadVersion { found: version, supported: layout::ABI_VERSION });
        }
        let capacity = check_capacity(u64_at(layout::OFF_CAPACITY))?;
        let data_offset = u64_at(layout::OFF_DATA_OFFSET);
        if data_offset != layout::DATA_OFFSET as u64 {
            return Err(ShmError::BadLayout { data_offset });
        }
        let needed = layout::DATA_OFFSET as u64 + capacity;
        if len < needed {
            return Err(ShmError::Truncated { len, needed });
        }
        let shared = map(file, capacity)?;
        // The header may have changed between the read and the mapping; what counts from now
        // on is the private `capacity`, and `check_header` reports any difference.
        shared.check_header()?;
        Ok(ShmRing { shared: Arc::new(shared) })
    }
}

impl AsFd for ShmRing {
    /// The file or memfd behind the ring, to pass to the peer.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.shared.file.as_fd()
    }
}

fn check_capacity(capacity: u64) -> Result<u64, ShmError> {
    let ok = capacity.is_power_of_two()
        && capacity >= layout::MIN_CAPACITY as u64
        && capacity <= layout::MAX_CAPACITY as u64
        && usize::try_from(capacity).is_ok();
    if ok {
        Ok(capacity)
    } else {
        Err(ShmError::BadCapacity { capacity })
    }
}

/// Maps exactly `DATA_OFFSET + capacity` bytes of `file`.
fn map(file: File, capacity: u64) -> Result<Shared, ShmError> {
    let len = layout::DATA_OFFSET as u64 + capacity;
    let len = usize::try_from(len).map_err(|_| ShmError::BadCapacity { capacity })?;
    let map = MmapOptions::new().len(len).map_raw(&file).map_err(io_err("mmap"))?;
    Ok(Shared { map, file, capacity })
}

/// Makes sure a memfd carries `F_SEAL_SHRINK`, adding it if needed.
fn ensure_shrink_seal(file: &File) -> Result<(), ShmError> {
    // SAFETY: F_GET_SEALS on an fd we own; no memory is passed.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        // EINVAL: a file on a filesystem without seals. It could be shrunk under us.
        let err = io::Error::last_os_error();
        return if err.raw_os_error() == Some(libc::EINVAL) {
            Err(ShmError::Unsealed)
        } else {
            Err(io_err("F_GET_SEALS")(err))
        };
    }
    if seals & libc::F_SEAL_SHRINK != 0 {
        return Ok(());
    }
    // SAFETY: F_ADD_SEALS on an fd we own; no memory is passed.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } < 0 {
        return Err(ShmError::Unsealed);
    }
    Ok(())
}

/// A new memfd named `name` (for `/proc/<pid>/fd`) of `len` bytes, close-on-exec, sealed
/// against shrinking and growing (and against further seals): a peer that receives it cannot
/// truncate it under this process's mapping, which would turn the next access into `SIGBUS`.
/// What [`ShmRing::create_memfd`] maps; other shared pages passed to untrusted peers (the
/// journal service's control blocks and doorbell) use it too.
pub fn sealed_memfd(name: &str, len: u64) -> Result<File, ShmError> {
    let cname = CString::new(name).map_err(|_| ShmError::Io {
        op: "memfd_create",
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })?;
    // SAFETY: `cname` is a valid NUL-terminated string for the duration of the call.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io_err("memfd_create")(io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by `memfd_create`, is open and owned by nobody else.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(len).map_err(io_err("ftruncate"))?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS on an fd we own; no memory is passed.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io_err("F_ADD_SEALS")(io::Error::last_os_error()));
    }
    Ok(file)
}
