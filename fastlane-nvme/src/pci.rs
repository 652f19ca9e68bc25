//! A PCI function bound to `vfio-pci`: the container, group and device file descriptors
//! (through `vfio-ioctls`), the BAR0 mapping and the command register.

use std::fmt;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::str::FromStr;
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};
use vfio_bindings::bindings::vfio::{
    VFIO_PCI_BAR0_REGION_INDEX, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_REGION_INFO_FLAG_MMAP,
};
use vfio_ioctls::{VfioContainer, VfioDevice};

use super::regs::Bar;
use super::NvmeError;

/// PCI command register offset in config space.
const PCI_COMMAND: u64 = 0x04;
/// Command register: memory space enable.
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
/// Command register: bus master enable (the device may DMA).
const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// Command register: INTx disable (the driver polls).
const PCI_COMMAND_INTX_DISABLE: u16 = 1 << 10;

/// A PCI address `DDDD:BB:DD.F`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bdf {
    /// Domain (segment).
    pub domain: u16,
    /// Bus.
    pub bus: u8,
    /// Device (0..32).
    pub device: u8,
    /// Function (0..8).
    pub function: u8,
}

impl FromStr for Bdf {
    type Err = NvmeError;

    /// `0000:00:04.0`, or `00:04.0` with domain 0.
    fn from_str(s: &str) -> Result<Bdf, NvmeError> {
        let bad = || NvmeError::BadBdf { text: s.to_string() };
        if s.len() > 16 {
            return Err(bad());
        }
        let parts: Vec<&str> = s.split(':').collect();
        let (domain, bus, rest) = match parts.as_slice() {
            [d, b, r] => (u16::from_str_radix(d, 16).map_err(|_| bad())?, *b, *r),
            [b, r] => (0, *b, *r),
            _ => return Err(bad()),
        };
        let (dev, func) = rest.split_once('.').ok_or_else(bad)?;
        let hex = |t: &str, max: u8| {
            u8::from_str_radix(t, 16).ok().filter(|&v| v <= max && !t.is_empty() && t.len() <= 2)
        };
        Ok(Bdf {
            domain,
            bus: hex(bus, 0xff).ok_or_else(bad)?,
            device: hex(dev, 0x1f).ok_or_else(bad)?,
            function: hex(func, 7).ok_or_else(bad)?,
        })
    }
}

impl fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.device, self.function)
    }
}

impl Bdf {
    /// `/sys/bus/pci/devices/<bdf>`.
    pub fn sysfs_path(&self) -> PathBuf {
        PathBuf::from(format!("/sys/bus/pci/devices/{self}"))
    }
}

/// The opened function: VFIO device, its container, and BAR0 mapped.
pub struct VfioPci {
    bdf: Bdf,
    bar0: Bar,
    /// BAR0 (MMIO, MAP_SHARED through the VFIO device fd), unmapped on drop: the controller
    /// that used it (and every queue, which hold `Arc`s to the controller) is gone before its
    /// `VfioPci` drops.
    bar0_map: MmapRaw,
    // Field order is drop order: BAR0 is unmapped before the device (and its group) closes,
    // and the device before the container.
    device: VfioDevice,
    container: Arc<VfioContainer>,
}

impl fmt::Debug for VfioPci {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VfioPci")
            .field("bdf", &self.bdf)
            .field("bar0_len", &self.bar0_map.len())
            .finish()
    }
}

// SAFETY: `VfioDevice` and `VfioContainer` are file descriptors with internal locking; the
// BAR0 mapping is owned here until `Drop` and only accessed through `Bar`'s volatile accesses.
unsafe impl Send for VfioPci {}
// SAFETY: as for `Send`.
unsafe impl Sync for VfioPci {}

impl VfioPci {
    /// Open the function at `bdf`, which must be bound to `vfio-pci`: set up a type1 IOMMU
    /// container for its group, map BAR0, and enable memory space and bus mastering (DMA).
    pub fn open(bdf: Bdf) -> Result<VfioPci, NvmeError> {
        let path = bdf.sysfs_path();
        let driver = std::fs::read_link(path.join("driver"))
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
        if driver.as_deref() != Some("vfio-pci") {
            return Err(NvmeError::NotVfio { bdf: bdf.to_string(), driver });
        }
        let container = Arc::new(
            VfioContainer::new(None)
                .map_err(|source| NvmeError::Vfio { what: "container", source })?,
        );
        let device = VfioDevice::new(&path, container.clone(), false)
            .map_err(|source| NvmeError::Vfio { what: "device", source })?;

        let flags = device.get_region_flags(VFIO_PCI_BAR0_REGION_INDEX);
        let size = device.get_region_size(VFIO_PCI_BAR0_REGION_INDEX);
        let offset = device.get_region_offset(VFIO_PCI_BAR0_REGION_INDEX);
        if flags & VFIO_REGION_INFO_FLAG_MMAP == 0 || !(0x2000..=1 << 30).contains(&size) {
            return Err(NvmeError::Bar0 { flags, size });
        }
        let len = size as usize;
        // The device's BAR0 through its VFIO fd at the offset VFIO gave, at a fresh
        // kernel-chosen address (MAP_SHARED, read-write).
        let bar0_map = MmapOptions::new()
            .offset(offset)
            .len(len)
            .map_raw(device.as_raw_fd())
            .map_err(|source| NvmeError::Bar0Map { source })?;
        let bar0_ptr = NonNull::new(bar0_map.as_mut_ptr()).expect("mmap returned NULL");
        // SAFETY: the mapping lives until `VfioPci` drops; every `Bar` copy is used only by
        // owners of an `Arc` to the controller that owns this `VfioPci`.
        let bar0 = unsafe { Bar::new(bar0_ptr, len) };
        let pci = VfioPci { bdf, bar0, bar0_map, device, container };
        pci.set_command(PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_INTX_DISABLE, 0);
        Ok(pci)
    }

    fn command(&self) -> u16 {
        let mut b = [0u8; 2];
        self.device.region_read(VFIO_PCI_CONFIG_REGION_INDEX, &mut b, PCI_COMMAND);
        u16::from_le_bytes(b)
    }

    fn set_command(&self, set: u16, clear: u16) {
        let cmd = (self.command() | set) & !clear;
        self.device.region_write(VFIO_PCI_CONFIG_REGION_INDEX, &cmd.to_le_bytes(), PCI_COMMAND);
    }

    /// Clear Bus Master Enable: from the read-back on, the function issues no more DMA. Used
    /// when the controller stops answering, before in-flight buffers go back to their owners.
    pub fn stop_dma(&self) {
        self.set_command(0, PCI_COMMAND_MASTER);
        // Read back so the (non-posted) config write has completed.
        let cmd = self.command();
        if cmd & PCI_COMMAND_MASTER != 0 {
            log::error!("{}: bus master still enabled after clearing it", self.bdf);
        }
    }

    /// Whether bus mastering is on.
    pub fn dma_enabled(&self) -> bool {
        self.command() & PCI_COMMAND_MASTER != 0
    }

    /// BAR0.
    pub fn bar0(&self) -> Bar {
        self.bar0
    }

    /// The container, for DMA mappings.
    pub fn container(&self) -> &Arc<VfioContainer> {
        &self.container
    }

    /// The address.
    pub fn bdf(&self) -> Bdf {
        self.bdf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdf_parsing() {
        let b: Bdf = "0000:00:04.0".parse().unwrap();
        assert_eq!(b, Bdf { domain: 0, bus: 0, device: 4, function: 0 });
        assert_eq!(b.to_string(), "0000:00:04.0");
        assert_eq!("01:1f.7".parse::<Bdf>().unwrap().to_string(), "0000:01:1f.7");
        assert_eq!("abcd:ff:00.1".parse::<Bdf>().unwrap().domain, 0xabcd);
        for bad in [
            "",
            "0000:00:04",
            "0000:00:20.0",
            "00:00.8",
            "x:00:00.0",
            "0:0:0:0.0",
            "00:04.",
            "000000000000:00:04.0",
        ] {
            assert!(matches!(bad.parse::<Bdf>(), Err(NvmeError::BadBdf { .. })), "{bad}");
        }
        assert_eq!(b.sysfs_path(), PathBuf::from("/sys/bus/pci/devices/0000:00:04.0"));
    }
}
