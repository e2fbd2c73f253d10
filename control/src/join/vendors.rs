//! The GPU vendors a worker can be added for, and what each needs on its host.
//!
//! Facts from GPUStack 2.3 (its add-worker commands and worker chart): the driver tool that
//! proves the driver works, the container runtime Docker must know, the host directories the
//! vendor's user-space libraries live in, and the PCI vendor id that Node Feature Discovery turns
//! into the node label `feature.node.kubernetes.io/pci-<id>.present=true`.

/// A host path bind-mounted into the worker container at the same path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMount {
    /// Volume name in the DaemonSet (a DNS-1123 label).
    pub name: &'static str,
    pub path: &'static str,
    pub read_only: bool,
    /// A single file (`/usr/bin/cnmon`) rather than a directory.
    pub file: bool,
}

const fn dir(name: &'static str, path: &'static str) -> HostMount {
    HostMount {
        name,
        path,
        read_only: true,
        file: false,
    }
}

// Where Docker and Kubernetes mount the same host paths.
const ROCM: &[HostMount] = &[
    dir("amd-rocm", "/opt/rocm"),
    // Separate: /opt/rocm/lib may be a symlink that would dangle inside the container.
    dir("amd-rocm-lib", "/opt/rocm/lib"),
];
const COREX: &[HostMount] = &[dir("iluvatar-corex", "/usr/local/corex")];
const NEUWARE: &[HostMount] = &[
    dir("cambricon-neuware", "/usr/local/neuware"),
    HostMount {
        name: "cambricon-cnmon",
        path: "/usr/bin/cnmon",
        read_only: true,
        file: true,
    },
];
const MACA: &[HostMount] = &[
    dir("metax-driver", "/opt/mxdriver"),
    dir("metax-maca", "/opt/maca"),
];

/// One GPU vendor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vendor {
    /// The name used in queries, DaemonSet names and labels (GPUStack's runtime names).
    pub id: &'static str,
    /// The name shown to people.
    pub name: &'static str,
    /// The product documents list it as experimental (tested: NVIDIA, AMD, Ascend).
    pub experimental: bool,
    /// PCI vendor id, lower-case hex, as Node Feature Discovery writes it.
    pub pci_id: &'static str,
    /// Shell command that succeeds only when the driver works.
    pub driver_check: &'static str,
    /// Container runtime Docker must have registered (`docker info` lists it), and that the
    /// worker container runs under.
    pub docker_runtime: Option<&'static str>,
    /// Extra `docker run` arguments, in order, written as they appear in the command.
    pub docker_args: &'static [&'static str],
    /// Host paths the worker container sees under Docker.
    pub docker_mounts: &'static [HostMount],
    /// Host paths the worker pod sees under Kubernetes.
    pub k8s_mounts: &'static [HostMount],
    /// Environment of the worker container (Docker and Kubernetes).
    pub env: &'static [(&'static str, &'static str)],
    /// `runtimeClassName` of the worker pod (the vendor's container runtime on the node).
    pub runtime_class: Option<&'static str>,
    /// Environment of the worker pod only (Docker asks with flags instead).
    pub k8s_env: &'static [(&'static str, &'static str)],
}

impl Vendor {
    /// The node label Node Feature Discovery sets on nodes with this vendor's PCI device.
    pub fn pci_label(&self) -> String {
        format!("feature.node.kubernetes.io/pci-{}.present", self.pci_id)
    }
}

/// Every vendor, tested ones first, then the experimental ones in the documents' order.
pub const VENDORS: &[Vendor] = &[
    Vendor {
        id: "nvidia",
        name: "NVIDIA",
        experimental: false,
        pci_id: "10de",
        driver_check: "nvidia-smi",
        docker_runtime: Some("nvidia"),
        // The runtime alone hands a container without NVIDIA's variables no GPU; `--gpus all`
        // asks for every one of them (NVIDIA's own sample workload passes both).
        docker_args: &["--gpus all"],
        docker_mounts: &[],
        k8s_mounts: &[],
        env: &[],
        runtime_class: Some("nvidia"),
        // The runtime hands a pod that requests no `nvidia.com/gpu` only the GPUs this names.
        k8s_env: &[("NVIDIA_VISIBLE_DEVICES", "all")],
    },
    Vendor {
        id: "amd",
        name: "AMD",
        experimental: false,
        pci_id: "1002",
        driver_check: "amd-smi static",
        docker_runtime: None,
        // ROCm's documented device set: no AMD container toolkit needed.
        docker_args: &[
            "--device /dev/kfd",
            "--device /dev/dri",
            "--group-add video",
        ],
        docker_mounts: ROCM,
        k8s_mounts: ROCM,
        env: &[],
        runtime_class: None,
        k8s_env: &[],
    },
    Vendor {
        id: "ascend",
        name: "Ascend",
        experimental: false,
        pci_id: "19e5",
        driver_check: "npu-smi info",
        docker_runtime: Some("ascend"),
        // Every NPU on the host (GPUStack's command passes only the first one).
        docker_args: &[
            r#"--env "ASCEND_VISIBLE_DEVICES=$(ls /dev/davinci[0-9]* | sed 's|/dev/davinci||' | paste -sd, -)""#,
        ],
        docker_mounts: &[dir("ascend-driver", "/usr/local/Ascend/driver")],
        k8s_mounts: &[
            dir("ascend-driver", "/usr/local/Ascend/driver"),
            dir("ascend-toolkit", "/usr/local/Ascend/ascend-toolkit"),
        ],
        env: &[],
        runtime_class: None,
        k8s_env: &[],
    },
    Vendor {
        id: "hygon",
        name: "Hygon",
        experimental: true,
        pci_id: "1d94",
        driver_check: "hy-smi",
        docker_runtime: None,
        docker_args: &[],
        docker_mounts: &[
            dir("hygon-hyhal", "/opt/hyhal"),
            dir("hygon-dtk", "/opt/dtk"),
        ],
        k8s_mounts: &[
            dir("hygon-hyhal", "/opt/hyhal"),
            dir("hygon-dtk", "/opt/dtk"),
            dir("hygon-mig-config", "/etc/dmi_mig_config"),
        ],
        env: &[
            ("ROCM_PATH", "/opt/dtk"),
            ("ROCM_SMI_LIB_PATH", "/opt/hyhal/lib"),
        ],
        runtime_class: None,
        k8s_env: &[],
    },
    Vendor {
        id: "mthreads",
        name: "Moore Threads",
        experimental: true,
        pci_id: "1ed5",
        driver_check: "mthreads-gmi",
        docker_runtime: Some("mthreads"),
        docker_args: &[],
        docker_mounts: &[],
        k8s_mounts: &[],
        env: &[],
        runtime_class: Some("mthreads"),
        k8s_env: &[],
    },
    Vendor {
        id: "iluvatar",
        name: "Iluvatar",
        experimental: true,
        pci_id: "1e3e",
        driver_check: "ixsmi",
        docker_runtime: Some("iluvatar"),
        docker_args: &[],
        docker_mounts: COREX,
        k8s_mounts: COREX,
        env: &[],
        runtime_class: None,
        k8s_env: &[],
    },
    Vendor {
        id: "cambricon",
        name: "Cambricon",
        experimental: true,
        pci_id: "cabc",
        driver_check: "cnmon info",
        docker_runtime: None,
        docker_args: &[],
        docker_mounts: NEUWARE,
        k8s_mounts: NEUWARE,
        env: &[],
        runtime_class: None,
        k8s_env: &[],
    },
    Vendor {
        id: "metax",
        name: "MetaX",
        experimental: true,
        pci_id: "9999",
        driver_check: "mx-smi",
        docker_runtime: None,
        docker_args: &[],
        docker_mounts: MACA,
        k8s_mounts: MACA,
        env: &[],
        runtime_class: None,
        k8s_env: &[],
    },
];

/// The vendor a query names: its id or display name, any case, with `-`, `_` and spaces ignored
/// (`Moore Threads`, `moore-threads` and GPUStack's UI spelling `moorthreads` are `mthreads`).
pub fn find(name: &str) -> Option<&'static Vendor> {
    let key: String = name
        .chars()
        .filter(|c| !matches!(c, '-' | '_' | ' '))
        .flat_map(char::to_lowercase)
        .collect();
    let key = match key.as_str() {
        "moorethreads" | "moorthreads" => "mthreads",
        other => other,
    };
    VENDORS
        .iter()
        .find(|v| v.id == key || v.name.to_lowercase().replace(' ', "") == key)
}

/// The known vendor ids, for error messages.
pub fn known() -> Vec<&'static str> {
    VENDORS.iter().map(|v| v.id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_found_in_any_spelling() {
        for (given, id) in [
            ("nvidia", "nvidia"),
            ("NVIDIA", "nvidia"),
            ("Moore Threads", "mthreads"),
            ("moore-threads", "mthreads"),
            ("moorthreads", "mthreads"),
            ("mthreads", "mthreads"),
            ("MetaX", "metax"),
            ("ascend", "ascend"),
        ] {
            assert_eq!(find(given).map(|v| v.id), Some(id), "{given}");
        }
        assert_eq!(find("intel"), None);
        assert_eq!(find(""), None);
    }

    #[test]
    fn the_table_is_consistent() {
        let mut ids = known();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), VENDORS.len());
        for v in VENDORS {
            assert_eq!(v.pci_id.len(), 4, "{}", v.id);
            assert!(v.pci_id.chars().all(|c| c.is_ascii_hexdigit()), "{}", v.id);
            for m in v.docker_mounts.iter().chain(v.k8s_mounts) {
                assert!(m.path.starts_with('/'), "{}", m.path);
                assert!(m.name.len() <= 63 && !m.name.starts_with('-'), "{}", m.name);
            }
        }
        let tested: Vec<_> = VENDORS
            .iter()
            .filter(|v| !v.experimental)
            .map(|v| v.id)
            .collect();
        assert_eq!(tested, ["nvidia", "amd", "ascend"]);
        assert_eq!(
            find("nvidia").unwrap().pci_label(),
            "feature.node.kubernetes.io/pci-10de.present"
        );
    }
}
