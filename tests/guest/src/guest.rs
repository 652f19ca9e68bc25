//! The one way the tests boot a guest: a builder over `tests/vm/run-guest.sh` (a QEMU TCG
//! guest with a busybox initramfs that runs one script as root and exits with its status).
//! The disk tests (`fastlane-cli/tests/vm_blk*.rs`), the VFIO test and the soft-RoCE tests
//! all start their guests through it.
//!
//! QEMU missing is a failure, not a skip: `.ci/install-deps.sh` installs it, and a test that
//! passes without running its guest checks nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The workspace root: the nearest directory above `manifest_dir` (canonical, so a symlinked
/// checkout still finds tests/vm) that holds `tests/vm/run-guest.sh`.
pub fn workspace_root(manifest_dir: &str) -> PathBuf {
    let dir = Path::new(manifest_dir);
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    dir.ancestors()
        .find(|d| d.join("tests/vm/run-guest.sh").is_file())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| panic!("no tests/vm/run-guest.sh above {}", dir.display()))
}

/// Panics unless `qemu-system-x86_64` runs.
pub fn require_qemu() {
    let ok = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(ok, "qemu-system-x86_64 is not installed (run .ci/install-deps.sh)");
}

/// One guest run, built up and then started with [`Guest::command`] or [`Guest::output`].
#[derive(Debug, Clone)]
pub struct Guest {
    root: PathBuf,
    args: Vec<String>,
    qemu: Vec<String>,
    mem: String,
}

impl Guest {
    /// A guest running `script` (a path relative to the workspace root, e.g.
    /// `tests/vm/guest-blk.sh`); `manifest_dir` is the caller's `CARGO_MANIFEST_DIR`. Panics
    /// when QEMU is missing.
    pub fn new(manifest_dir: &str, script: &str) -> Guest {
        require_qemu();
        let root = workspace_root(manifest_dir);
        let script = root.join(script);
        assert!(script.is_file(), "no guest script {}", script.display());
        Guest {
            root,
            args: vec!["--script".into(), script.display().to_string()],
            qemu: Vec::new(),
            mem: "512M".into(),
        }
    }

    /// The workspace root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn arg(mut self, flag: &str, value: impl Into<String>) -> Guest {
        self.args.push(flag.into());
        self.args.push(value.into());
        self
    }

    /// A host binary copied to the guest's `/bin` (with its shared libraries).
    pub fn bin(self, path: impl AsRef<Path>) -> Guest {
        let p = path.as_ref().display().to_string();
        self.arg("--bin", p)
    }

    /// A host shared library copied to the same path (for dlopen'ed plugins).
    pub fn lib(self, path: &str) -> Guest {
        self.arg("--lib", path)
    }

    /// A file copied to `dst` in the guest.
    pub fn file(self, src: &str, dst: &str) -> Guest {
        self.arg("--file", format!("{src}:{dst}"))
    }

    /// Kernel modules loaded before the script, space-separated, dependencies first.
    pub fn modules(self, modules: &str) -> Guest {
        self.arg("--modules", modules)
    }

    /// vCPUs.
    pub fn smp(self, n: u32) -> Guest {
        self.arg("--smp", n.to_string())
    }

    /// Guest memory (`512M` unless set).
    pub fn mem(mut self, size: &str) -> Guest {
        self.mem = size.into();
        self.arg("--mem", size)
    }

    /// Extra kernel command-line arguments (the scripts read their `fl_*` settings there).
    pub fn append(self, args: &str) -> Guest {
        self.arg("--append", args)
    }

    /// The hard bound on the whole QEMU run, seconds (run-guest.sh then fails with 124).
    pub fn timeout_s(self, seconds: u64) -> Guest {
        self.arg("--timeout", seconds.to_string())
    }

    /// More arguments for qemu-system-x86_64 itself.
    pub fn qemu<I, S>(mut self, args: I) -> Guest
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.qemu.extend(args.into_iter().map(Into::into));
        self
    }

    /// A vhost-user-blk disk on `socket` with `queues` queues; guest memory becomes a shared
    /// memfd (vhost-user needs it). With `reconnect`, QEMU reconnects to a restarted backend
    /// every second.
    pub fn vhost_user_blk(self, socket: &Path, queues: u32, reconnect: bool) -> Guest {
        let mem = self.mem.clone();
        let reconnect = if reconnect { ",reconnect=1" } else { "" };
        self.modules("virtio_pci virtio_blk").qemu([
            "-object".to_string(),
            format!("memory-backend-memfd,id=mem,size={mem},share=on"),
            "-machine".to_string(),
            "memory-backend=mem".to_string(),
            "-chardev".to_string(),
            format!("socket,id=c0,path={}{reconnect}", socket.display()),
            "-device".to_string(),
            format!("vhost-user-blk-pci,chardev=c0,num-queues={queues}"),
        ])
    }

    /// The `run-guest.sh` command, stdin closed, ready to spawn.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(self.root.join("tests/vm/run-guest.sh"));
        cmd.args(&self.args);
        if !self.qemu.is_empty() {
            cmd.arg("--").args(&self.qemu);
        }
        cmd.stdin(Stdio::null());
        cmd
    }

    /// Runs the guest to its end.
    pub fn output(&self) -> Output {
        self.command().output().expect("run tests/vm/run-guest.sh")
    }
}
